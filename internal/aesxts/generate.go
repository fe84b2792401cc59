package aesxts

//go:generate sh -c "cd _asm && go run . -out ../aesxts_amd64.s"

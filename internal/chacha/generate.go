package chacha

//go:generate sh -c "cd _asm && go run . -out ../chacha_amd64.s"

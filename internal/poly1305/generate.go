package poly1305

//go:generate sh -c "cd _asm && go run . -out ../poly1305_amd64.s"

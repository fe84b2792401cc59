// The assembly generator lives in its own module so that nothing it might ever import
// enters the main module's go.mod. It has no dependencies today.
module asmgen

go 1.26

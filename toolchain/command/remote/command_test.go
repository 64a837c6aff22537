package remote

import "testing"

func TestOnlyConnectionAuthChangedSkipsTheRerun(t *testing.T) {
	str := func(s string) *string { return &s }
	base := func() CommandInputs {
		return CommandInputs{Connection: Connection{connectionBase: connectionBase{Host: "10.0.0.1", User: str("me")}},
			Create: str("preflight")}
	}
	old, pinned := base(), base()
	pinned.Connection.HostKey = str("ssh-ed25519 AAAA")
	pinned.Connection.PrivateKey = str("new key")
	if !OnlyConnectionAuthChanged(old, pinned) {
		t.Error("a new host key or private key alone must not re-run the command")
	}
	if OnlyConnectionAuthChanged(old, base()) {
		t.Error("no change at all is not an auth-only change")
	}
	moved := base()
	moved.Connection.Host = "10.0.0.9"
	moved.Connection.HostKey = str("ssh-ed25519 AAAA")
	if OnlyConnectionAuthChanged(old, moved) {
		t.Error("another host must run the command there")
	}
	edited := base()
	edited.Create = str("preflight v2")
	edited.Connection.HostKey = str("ssh-ed25519 AAAA")
	if OnlyConnectionAuthChanged(old, edited) {
		t.Error("a changed command must run")
	}
}

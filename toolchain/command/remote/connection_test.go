package remote

import (
	"context"
	"crypto/ed25519"
	"crypto/rand"
	"crypto/rsa"
	"errors"
	"fmt"
	"net"
	"testing"

	"golang.org/x/crypto/ssh"
)

func newKey(t *testing.T) ssh.PublicKey {
	t.Helper()
	pub, _, err := ed25519.GenerateKey(rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	k, err := ssh.NewPublicKey(pub)
	if err != nil {
		t.Fatal(err)
	}
	return k
}

var addr = &net.TCPAddr{IP: net.IPv4(127, 0, 0, 1), Port: 22}

func TestHostKeyCallback(t *testing.T) {
	server, other := newKey(t), newKey(t)
	authorized := keyString(server) + " root@node"
	knownHosts := "[127.0.0.1]:2222 " + keyString(server)

	for name, expected := range map[string]string{"authorized_keys form": authorized, "known_hosts form": knownHosts} {
		cb, err := HostKeyCallback(&expected)
		if err != nil {
			t.Fatalf("%s: %v", name, err)
		}
		if err := cb("127.0.0.1:2222", addr, server); err != nil {
			t.Errorf("%s: the expected key was refused: %v", name, err)
		}
		err = cb("127.0.0.1:2222", addr, other)
		if !errors.Is(err, ErrHostKeyMismatch) {
			t.Errorf("%s: another key was accepted (err=%v)", name, err)
		}
	}

	for _, expected := range []*string{nil, new(string)} {
		cb, err := HostKeyCallback(expected)
		if err != nil {
			t.Fatal(err)
		}
		if err := cb("h", addr, other); err != nil {
			t.Errorf("no hostKey must accept any key (upstream), got %v", err)
		}
	}

	bad := "not a key"
	if _, err := HostKeyCallback(&bad); err == nil {
		t.Error("a malformed hostKey was accepted")
	}
}

func TestReachedDialLimit(t *testing.T) {
	cases := []struct {
		failures, limit int
		want            bool
	}{
		{1, 10, false}, {10, 10, false}, {11, 10, true},
		{1, 0, true},
		{1000, -1, false},
	}
	for _, c := range cases {
		if got := ReachedDialLimit(c.failures, c.limit); got != c.want {
			t.Errorf("ReachedDialLimit(%d, %d) = %v, want %v", c.failures, c.limit, got, c.want)
		}
	}
}

func TestEndpointDefaults(t *testing.T) {
	c := connectionBase{Host: "::1"}
	if got := c.endpoint(); got != "[::1]:22" {
		t.Errorf("endpoint = %q", got)
	}
	port := 2222.0
	c.Port = &port
	if got := c.endpoint(); got != "[::1]:2222" {
		t.Errorf("endpoint = %q", got)
	}
	if c.dialErrorLimit() != 10 || c.perDialTimeout().Seconds() != 15 {
		t.Errorf("defaults: limit %d timeout %v", c.dialErrorLimit(), c.perDialTimeout())
	}
	zero := 0
	c.PerDialTimeout = &zero
	if c.perDialTimeout() != 0 {
		t.Errorf("perDialTimeout 0 must mean no maximum")
	}
}

func TestPinnedKeyTypeIsNegotiated(t *testing.T) {
	ed := newKey(t)
	if got := HostKeyAlgorithms(ed); len(got) != 1 || got[0] != ssh.KeyAlgoED25519 {
		t.Errorf("ed25519 pin negotiates %v", got)
	}
	priv, err := rsa.GenerateKey(rand.Reader, 2048)
	if err != nil {
		t.Fatal(err)
	}
	k, err := ssh.NewPublicKey(&priv.PublicKey)
	if err != nil {
		t.Fatal(err)
	}
	if got := HostKeyAlgorithms(k); len(got) != 3 || got[2] != ssh.KeyAlgoRSA {
		t.Errorf("rsa pin negotiates %v", got)
	}
}

func TestHostKeyMismatchIsNotRetried(t *testing.T) {
	calls := 0
	_, err := retryDial(context.Background(), "Dial h:22", 10, func() (int, error) {
		calls++
		return 0, fmt.Errorf("ssh: handshake failed: %w", ErrHostKeyMismatch)
	})
	if calls != 1 || !errors.Is(err, ErrHostKeyMismatch) {
		t.Errorf("a host key mismatch was tried %d times (err=%v); it must fail at once", calls, err)
	}
}

// Package remote serves command:remote:Command and command:remote:CopyToRemote over ssh.
package remote

import (
	"bytes"
	"context"
	"crypto/subtle"
	"errors"
	"fmt"
	"net"
	"os"
	"strings"
	"time"

	p "github.com/pulumi/pulumi-go-provider"
	"github.com/pulumi/pulumi-go-provider/infer"
	"golang.org/x/crypto/ssh"
	"golang.org/x/crypto/ssh/agent"
)

const (
	defaultPort           = 22
	defaultUser           = "root"
	defaultDialErrorLimit = 10
	defaultPerDialTimeout = 15
	sshAuthSockEnv        = "SSH_AUTH_SOCK"
)

// connectionBase holds the fields shared by a connection and its proxy (jump host).
type connectionBase struct {
	Host               string   `pulumi:"host"`
	Port               *float64 `pulumi:"port,optional"`
	User               *string  `pulumi:"user,optional"`
	Password           *string  `pulumi:"password,optional"`
	PrivateKey         *string  `pulumi:"privateKey,optional"`
	PrivateKeyPassword *string  `pulumi:"privateKeyPassword,optional"`
	AgentSocketPath    *string  `pulumi:"agentSocketPath,optional"`
	DialErrorLimit     *int     `pulumi:"dialErrorLimit,optional"`
	PerDialTimeout     *int     `pulumi:"perDialTimeout,optional"`
	HostKey            *string  `pulumi:"hostKey,optional"`
}

// Connection is command:remote:Connection.
type Connection struct {
	connectionBase
	Proxy *ProxyConnection `pulumi:"proxy,optional"`
}

// ProxyConnection is command:remote:ProxyConnection (the bastion host).
type ProxyConnection struct {
	connectionBase
}

func annotateBase(a infer.Annotator, c *connectionBase, what string) {
	a.Describe(&c.Host, "The address of the "+what+" to connect to.")
	a.Describe(&c.Port, "The port to connect to. Defaults to 22.")
	a.SetDefault(&c.Port, defaultPort)
	a.Describe(&c.User, "The user that we should use for the connection.")
	a.SetDefault(&c.User, defaultUser)
	a.Describe(&c.Password, "The password we should use for the connection.")
	a.Describe(&c.PrivateKey, "The contents of an SSH key to use for the connection. This takes preference over the password if provided.")
	a.Describe(&c.PrivateKeyPassword, "The password to use in case the private key is encrypted.")
	a.Describe(&c.AgentSocketPath, "SSH Agent socket path. Default to environment variable SSH_AUTH_SOCK if present.")
	a.Describe(&c.DialErrorLimit, "Max allowed errors on trying to dial the remote host. -1 set count to unlimited. Default value is 10.")
	a.SetDefault(&c.DialErrorLimit, defaultDialErrorLimit)
	a.Describe(&c.PerDialTimeout, "Max number of seconds for each dial attempt. 0 implies no maximum. Default value is 15 seconds.")
	a.SetDefault(&c.PerDialTimeout, defaultPerDialTimeout)
	a.Describe(&c.HostKey, "The expected host key to verify the server's identity. If not provided, the host key will be ignored.")
}

func (c *Connection) Annotate(a infer.Annotator) {
	a.Describe(c, "Instructions for how to connect to a remote endpoint.")
	a.SetToken("remote", "Connection")
	annotateBase(a, &c.connectionBase, "resource")
	a.Describe(&c.Proxy, "The connection settings for the bastion/proxy host.")
}

func (c *ProxyConnection) Annotate(a infer.Annotator) {
	a.Describe(c, "Instructions for how to connect to a remote endpoint via a bastion host.")
	a.SetToken("remote", "ProxyConnection")
	annotateBase(a, &c.connectionBase, "bastion host")
}

func (c *connectionBase) endpoint() string {
	port := float64(defaultPort)
	if c.Port != nil {
		port = *c.Port
	}
	return net.JoinHostPort(c.Host, fmt.Sprintf("%d", int(port)))
}

func (c *connectionBase) dialErrorLimit() int {
	if c.DialErrorLimit == nil {
		return defaultDialErrorLimit
	}
	return *c.DialErrorLimit
}

func (c *connectionBase) perDialTimeout() time.Duration {
	s := defaultPerDialTimeout
	if c.PerDialTimeout != nil {
		s = *c.PerDialTimeout
	}
	if s <= 0 {
		return 0
	}
	return time.Duration(s) * time.Second
}

// ParseHostKey accepts a public key in authorized_keys form ("ssh-ed25519 AAAA... [comment]") or a
// known_hosts line ("host ssh-ed25519 AAAA...").
func ParseHostKey(s string) (ssh.PublicKey, error) {
	s = strings.TrimSpace(s)
	if key, _, _, _, err := ssh.ParseAuthorizedKey([]byte(s)); err == nil {
		return key, nil
	}
	if _, _, key, _, _, err := ssh.ParseKnownHosts([]byte(s)); err == nil {
		return key, nil
	}
	return nil, fmt.Errorf("hostKey is neither an authorized_keys nor a known_hosts line: %q", s)
}

// ErrHostKeyMismatch is returned when the server's key is not the expected one.
var ErrHostKeyMismatch = errors.New("ssh: host key mismatch")

// HostKeyAlgorithms are the algorithms to negotiate for a pinned key: a server with several host keys
// must show the pinned one, not the first type the client would prefer.
func HostKeyAlgorithms(k ssh.PublicKey) []string {
	if k.Type() == ssh.KeyAlgoRSA {
		return []string{ssh.KeyAlgoRSASHA512, ssh.KeyAlgoRSASHA256, ssh.KeyAlgoRSA}
	}
	return []string{k.Type()}
}

// HostKeyCallback verifies the server's key against expected; nil or empty accepts any key (upstream).
func HostKeyCallback(expected *string) (ssh.HostKeyCallback, error) {
	if expected == nil || strings.TrimSpace(*expected) == "" {
		return ssh.InsecureIgnoreHostKey(), nil //nolint:gosec // upstream behaviour without hostKey
	}
	want, err := ParseHostKey(*expected)
	if err != nil {
		return nil, err
	}
	return func(hostname string, _ net.Addr, got ssh.PublicKey) error {
		if got.Type() == want.Type() && subtle.ConstantTimeCompare(got.Marshal(), want.Marshal()) == 1 {
			return nil
		}
		return fmt.Errorf("%w for %s: expected %s %s, server offered %s %s; the connection was refused "+
			"(if the host was reinstalled, update the pinned hostKey)", ErrHostKeyMismatch, hostname,
			want.Type(), ssh.FingerprintSHA256(want), got.Type(), ssh.FingerprintSHA256(got))
	}, nil
}

// clientConfig builds the ssh config; the returned closer releases an agent connection.
func (c *connectionBase) clientConfig(ctx context.Context) (*ssh.ClientConfig, func(), error) {
	hk, err := HostKeyCallback(c.HostKey)
	if err != nil {
		return nil, nil, err
	}
	user := defaultUser
	if c.User != nil {
		user = *c.User
	}
	cfg := &ssh.ClientConfig{User: user, HostKeyCallback: hk, Timeout: c.perDialTimeout()}
	if c.HostKey != nil && strings.TrimSpace(*c.HostKey) != "" {
		want, _ := ParseHostKey(*c.HostKey) // parsed by HostKeyCallback above
		cfg.HostKeyAlgorithms = HostKeyAlgorithms(want)
	}
	if c.PrivateKey != nil && *c.PrivateKey != "" {
		var signer ssh.Signer
		if c.PrivateKeyPassword != nil && *c.PrivateKeyPassword != "" {
			signer, err = ssh.ParsePrivateKeyWithPassphrase([]byte(*c.PrivateKey), []byte(*c.PrivateKeyPassword))
		} else {
			signer, err = ssh.ParsePrivateKey([]byte(*c.PrivateKey))
		}
		if err != nil {
			return nil, nil, fmt.Errorf("privateKey: %w", err)
		}
		cfg.Auth = append(cfg.Auth, ssh.PublicKeys(signer))
	}
	if c.Password != nil && *c.Password != "" {
		pw := *c.Password
		cfg.Auth = append(cfg.Auth, ssh.Password(pw), ssh.KeyboardInteractive(
			func(_, _ string, questions []string, _ []bool) ([]string, error) {
				answers := make([]string, len(questions))
				for i := range answers {
					answers[i] = pw
				}
				return answers, nil
			}))
	}
	closer := func() {}
	sock, explicit := "", false
	if c.AgentSocketPath != nil && *c.AgentSocketPath != "" {
		sock, explicit = *c.AgentSocketPath, true
	} else {
		sock = os.Getenv(sshAuthSockEnv)
	}
	if sock != "" {
		conn, err := net.Dial("unix", sock)
		switch {
		case err == nil:
			cfg.Auth = append(cfg.Auth, ssh.PublicKeysCallback(agent.NewClient(conn).Signers))
			closer = func() { _ = conn.Close() }
		case explicit:
			return nil, nil, fmt.Errorf("agentSocketPath %s: %w", sock, err)
		default:
			p.GetLogger(ctx).Debugf("ignoring %s=%s: %v", sshAuthSockEnv, sock, err)
		}
	}
	return cfg, closer, nil
}

// ReachedDialLimit: after `failures` failed dials, stop when the limit (-1 = unlimited) is exceeded,
// so limit N allows N failures and fails on the next one (upstream's counting).
func ReachedDialLimit(failures, limit int) bool {
	return limit > -1 && failures > limit
}

// retryDial runs f until it succeeds or the limit of failures is exceeded, backing off between tries.
func retryDial[T any](ctx context.Context, what string, limit int, f func() (T, error)) (T, error) {
	var zero T
	delay := 250 * time.Millisecond
	for failures := 1; ; failures++ {
		v, err := f()
		if err == nil {
			return v, nil
		}
		if errors.Is(err, ErrHostKeyMismatch) { // not transient: another try meets the same key
			return zero, fmt.Errorf("%s: %w", what, err)
		}
		if ReachedDialLimit(failures, limit) {
			return zero, fmt.Errorf("%s %s: after %d failed attempts: %w", what, "failed", failures, err)
		}
		lim := "inf"
		if limit >= 0 {
			lim = fmt.Sprint(limit)
		}
		p.GetLogger(ctx).InfoStatusf("%s %d/%s failed: %v; retrying", what, failures, lim, err)
		select {
		case <-ctx.Done():
			return zero, fmt.Errorf("%s: %w (last error: %v)", what, ctx.Err(), err)
		case <-time.After(delay):
		}
		delay = min(delay*3/2, 5*time.Second)
	}
}

// handshake runs the ssh handshake over conn, bounded by the per-dial timeout.
func handshake(conn net.Conn, addr string, cfg *ssh.ClientConfig) (*ssh.Client, error) {
	if cfg.Timeout > 0 {
		_ = conn.SetDeadline(time.Now().Add(cfg.Timeout))
	}
	c, chans, reqs, err := ssh.NewClientConn(conn, addr, cfg)
	if err != nil {
		_ = conn.Close()
		return nil, err
	}
	_ = conn.SetDeadline(time.Time{})
	return ssh.NewClient(c, chans, reqs), nil
}

func dialDirect(ctx context.Context, c *connectionBase, cfg *ssh.ClientConfig) (*ssh.Client, error) {
	addr := c.endpoint()
	return retryDial(ctx, "Dial "+addr, c.dialErrorLimit(), func() (*ssh.Client, error) {
		d := net.Dialer{Timeout: cfg.Timeout}
		conn, err := d.DialContext(ctx, "tcp", addr)
		if err != nil {
			return nil, err
		}
		return handshake(conn, addr, cfg)
	})
}

// sshClient is a dialled connection; Close also closes the proxy hop and agent sockets.
type sshClient struct {
	*ssh.Client
	closers []func()
}

func (s *sshClient) Close() error {
	err := s.Client.Close()
	for i := len(s.closers) - 1; i >= 0; i-- {
		s.closers[i]()
	}
	return err
}

// Dial connects (through the proxy when one is given), retrying up to dialErrorLimit.
func (c *Connection) Dial(ctx context.Context) (*sshClient, error) {
	cfg, closeAgent, err := c.clientConfig(ctx)
	if err != nil {
		return nil, err
	}
	if c.Proxy == nil {
		client, err := dialDirect(ctx, &c.connectionBase, cfg)
		if err != nil {
			closeAgent()
			return nil, err
		}
		return &sshClient{client, []func(){closeAgent}}, nil
	}
	pcfg, closeProxyAgent, err := c.Proxy.clientConfig(ctx)
	if err != nil {
		closeAgent()
		return nil, fmt.Errorf("proxy: %w", err)
	}
	cleanup := func() { closeAgent(); closeProxyAgent() }
	proxy, err := dialDirect(ctx, &c.Proxy.connectionBase, pcfg)
	if err != nil {
		cleanup()
		return nil, fmt.Errorf("proxy: %w", err)
	}
	addr := c.endpoint()
	client, err := retryDial(ctx, "Dial "+addr+" via proxy", c.dialErrorLimit(), func() (*ssh.Client, error) {
		dctx, cancel := ctx, context.CancelFunc(func() {})
		if cfg.Timeout > 0 {
			dctx, cancel = context.WithTimeout(ctx, cfg.Timeout)
		}
		defer cancel()
		conn, err := proxy.DialContext(dctx, "tcp", addr)
		if err != nil {
			return nil, err
		}
		return handshake(conn, addr, cfg)
	})
	if err != nil {
		_ = proxy.Close()
		cleanup()
		return nil, fmt.Errorf("proxy: %w", err)
	}
	return &sshClient{client, []func(){func() { _ = proxy.Close() }, cleanup}}, nil
}

// keyString renders a public key in authorized_keys form (for messages and tests).
func keyString(k ssh.PublicKey) string { return string(bytes.TrimSpace(ssh.MarshalAuthorizedKey(k))) }

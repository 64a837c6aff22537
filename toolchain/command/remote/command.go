package remote

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"reflect"
	"strings"

	p "github.com/pulumi/pulumi-go-provider"
	"github.com/pulumi/pulumi-go-provider/infer"
	"github.com/pulumi/pulumi/sdk/v3/go/common/resource"
	"golang.org/x/crypto/ssh"

	"dsv41-exl3/toolchain/command/internal/common"
)

// Logging is command:remote:Logging.
type Logging string

func (Logging) Values() []infer.EnumValue[Logging] {
	return []infer.EnumValue[Logging]{
		{Name: "Stdout", Value: common.LogStdout, Description: "Capture stdout in logs but not stderr"},
		{Name: "Stderr", Value: common.LogStderr, Description: "Capture stderr in logs but not stdout"},
		{Name: "StdoutAndStderr", Value: common.LogStdoutAndStderr, Description: "Capture stdout and stderr in logs"},
		{Name: "None", Value: common.LogNone, Description: "Capture no logs"},
	}
}

func logMode(l *Logging) string {
	if l == nil {
		return ""
	}
	return string(*l)
}

// Command is command:remote:Command.
type Command struct{}

var (
	_ infer.CustomResource[CommandInputs, CommandOutputs] = (*Command)(nil)
	_ infer.CustomUpdate[CommandInputs, CommandOutputs]   = (*Command)(nil)
	_ infer.CustomDelete[CommandOutputs]                  = (*Command)(nil)
	_ infer.CustomCheck[CommandInputs]                    = (*Command)(nil)
)

func (c *Command) Annotate(a infer.Annotator) {
	a.Describe(c, "A command to run on a remote host. The connection is established via ssh.")
	a.SetToken("remote", "Command")
}

// CommandInputs are the inputs of command:remote:Command.
type CommandInputs struct {
	Connection             Connection        `pulumi:"connection" provider:"secret"`
	Environment            map[string]string `pulumi:"environment,optional"`
	Triggers               []any             `pulumi:"triggers,optional" provider:"replaceOnChanges"`
	Create                 *string           `pulumi:"create,optional"`
	Delete                 *string           `pulumi:"delete,optional"`
	Update                 *string           `pulumi:"update,optional"`
	Stdin                  *string           `pulumi:"stdin,optional"`
	Logging                *Logging          `pulumi:"logging,optional"`
	AddPreviousOutputInEnv *bool             `pulumi:"addPreviousOutputInEnv,optional"`
}

func (c *CommandInputs) Annotate(a infer.Annotator) {
	a.Describe(&c.Connection, "The parameters with which to connect to the remote host.")
	a.Describe(&c.Environment, "Additional environment variables available to the command's process. "+
		"Sent with ssh Setenv: the SSH server must accept them (AcceptEnv), else the command fails.")
	a.Describe(&c.Triggers, "Trigger a resource replacement on changes to any of these values.")
	a.Describe(&c.Create, "The command to run once on resource creation (and on updates when `update` is not set).")
	a.Describe(&c.Delete, "The command to run on resource deletion, with the previous outputs in PULUMI_COMMAND_STDOUT/STDERR.")
	a.Describe(&c.Update, "The command to run when the resource's inputs change; `create` runs when it is not set.")
	a.Describe(&c.Stdin, "Pass a string to the command's process as standard in.")
	a.Describe(&c.Logging, "If the command's stdout and stderr should be logged. Defaults to logging both.")
	a.Describe(&c.AddPreviousOutputInEnv, "If the previous command's stdout and stderr are injected into the "+
		"environment of the next run as PULUMI_COMMAND_STDOUT and PULUMI_COMMAND_STDERR. Defaults to true.")
	a.SetDefault(&c.AddPreviousOutputInEnv, true)
}

// CommandOutputs are the outputs: the inputs plus stdout and stderr.
type CommandOutputs struct {
	CommandInputs
	Stdout string `pulumi:"stdout"`
	Stderr string `pulumi:"stderr"`
}

func (c *CommandOutputs) Annotate(a infer.Annotator) {
	a.Describe(&c.Stdout, "The standard output of the command's process")
	a.Describe(&c.Stderr, "The standard error of the command's process")
}

// Check applies defaults (infer's) and validates the logging value.
func (*Command) Check(ctx context.Context, req infer.CheckRequest) (infer.CheckResponse[CommandInputs], error) {
	in, failures, err := infer.DefaultCheck[CommandInputs](ctx, req.NewInputs)
	if err == nil && !common.ValidLogging(logMode(in.Logging)) {
		failures = append(failures, p.CheckFailure{Property: "logging",
			Reason: fmt.Sprintf("logging must be one of stdout, stderr, stdoutAndStderr, none; got %q", *in.Logging)})
	}
	return infer.CheckResponse[CommandInputs]{Inputs: in, Failures: failures}, err
}

func (*Command) Create(ctx context.Context, req infer.CreateRequest[CommandInputs]) (
	infer.CreateResponse[CommandOutputs], error) {
	state := CommandOutputs{CommandInputs: req.Inputs}
	id, err := resource.NewUniqueHex(req.Name, 8, 0)
	if err != nil {
		return infer.CreateResponse[CommandOutputs]{}, err
	}
	if req.DryRun || state.Create == nil {
		return infer.CreateResponse[CommandOutputs]{ID: id, Output: state}, nil
	}
	state.Stdout, state.Stderr, err = state.run(ctx, "create", *state.Create)
	return infer.CreateResponse[CommandOutputs]{ID: id, Output: state}, err
}

func (*Command) Update(ctx context.Context, req infer.UpdateRequest[CommandInputs, CommandOutputs]) (
	infer.UpdateResponse[CommandOutputs], error) {
	state := CommandOutputs{CommandInputs: req.Inputs, Stdout: req.State.Stdout, Stderr: req.State.Stderr}
	if req.DryRun {
		return infer.UpdateResponse[CommandOutputs]{Output: state}, nil
	}
	if OnlyConnectionAuthChanged(req.State.CommandInputs, req.Inputs) {
		// A new key, password or pinned host key is not a new command: running it again would repeat its
		// effects (a preflight stops containers) for no change on the host.
		p.GetLogger(ctx).Info("only the connection's credentials or host key changed: the command is not run again")
		return infer.UpdateResponse[CommandOutputs]{Output: state}, nil
	}
	op, cmd := "update", req.Inputs.Update
	if cmd == nil {
		op, cmd = "create", req.Inputs.Create
	}
	if cmd == nil {
		return infer.UpdateResponse[CommandOutputs]{Output: state}, nil
	}
	var err error
	state.Stdout, state.Stderr, err = state.run(ctx, op, *cmd)
	return infer.UpdateResponse[CommandOutputs]{Output: state}, err
}

func (*Command) Delete(ctx context.Context, req infer.DeleteRequest[CommandOutputs]) (infer.DeleteResponse, error) {
	if req.State.Delete == nil {
		return infer.DeleteResponse{}, nil
	}
	_, _, err := req.State.run(ctx, "delete", *req.State.Delete)
	return infer.DeleteResponse{}, err
}

// withoutAuth drops what says how to authenticate and verify, keeping where to connect.
func withoutAuth(c connectionBase) connectionBase {
	c.Password, c.PrivateKey, c.PrivateKeyPassword, c.AgentSocketPath = nil, nil, nil, nil
	c.DialErrorLimit, c.PerDialTimeout, c.HostKey = nil, nil, nil
	return c
}

// OnlyConnectionAuthChanged: the inputs differ, and only in the connection's (or its proxy's)
// credentials, host key or dial settings; host, port, user and everything else are equal.
func OnlyConnectionAuthChanged(old, cur CommandInputs) bool {
	if reflect.DeepEqual(old, cur) {
		return false
	}
	strip := func(in CommandInputs) CommandInputs {
		in.Connection.connectionBase = withoutAuth(in.Connection.connectionBase)
		if in.Connection.Proxy != nil {
			proxy := *in.Connection.Proxy
			proxy.connectionBase = withoutAuth(proxy.connectionBase)
			in.Connection.Proxy = &proxy
		}
		return in
	}
	return reflect.DeepEqual(strip(old), strip(cur))
}

// run executes cmd over a new ssh session; the state's Stdout/Stderr are the previous outputs.
func (c *CommandOutputs) run(ctx context.Context, op, cmd string) (string, string, error) {
	log := p.GetLogger(ctx)
	client, err := c.Connection.Dial(ctx)
	if err != nil {
		return "", "", err
	}
	defer client.Close()
	session, err := client.NewSession()
	if err != nil {
		return "", "", fmt.Errorf("ssh session: %w", err)
	}
	defer session.Close()

	for _, v := range common.SortedEnv(c.Environment) {
		if err := session.Setenv(v.Key, v.Value); err != nil {
			return "", "", fmt.Errorf("could not set environment variable %q: %w. This only works if the SSH "+
				"server accepts the variable (sshd_config AcceptEnv); alternatively prefix the command with "+
				"'VAR=value'", v.Key, err)
		}
	}
	for _, v := range common.PreviousOutputEnv(c.AddPreviousOutputInEnv, c.Stdout, c.Stderr) {
		if err := session.Setenv(v.Key, v.Value); err != nil {
			log.Warningf("Unable to set '%s': the SSH server does not accept it (AcceptEnv); set "+
				"addPreviousOutputInEnv=false to stop trying", v.Key)
		}
	}
	if c.Stdin != nil && *c.Stdin != "" {
		session.Stdin = strings.NewReader(*c.Stdin)
	}
	var stdout, stderr bytes.Buffer
	lines := common.NewLineWriter(func(s string) { log.Info(s) })
	mode := logMode(c.Logging)
	outW, errW := io.Writer(&stdout), io.Writer(&stderr)
	if common.ShouldLogStdout(mode) {
		outW = io.MultiWriter(&stdout, lines)
	}
	if common.ShouldLogStderr(mode) {
		errW = io.MultiWriter(&stderr, lines)
	}
	session.Stdout, session.Stderr = outW, errW

	done := make(chan struct{})
	go func() {
		select {
		case <-ctx.Done():
			_ = session.Signal(ssh.SIGTERM)
			_ = client.Close()
		case <-done:
		}
	}()
	err = session.Run(cmd)
	close(done)
	lines.Flush()
	if err != nil {
		var exit *ssh.ExitError
		if errors.As(err, &exit) {
			err = fmt.Errorf("exit status %d", exit.ExitStatus())
		}
		return "", "", common.CommandError(op, err, stdout.String(), stderr.String())
	}
	return common.TrimOutput(stdout.String()), common.TrimOutput(stderr.String()), nil
}

// Package local serves command:local:Command.
package local

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"time"

	p "github.com/pulumi/pulumi-go-provider"
	"github.com/pulumi/pulumi-go-provider/infer"
	"github.com/pulumi/pulumi/sdk/v3/go/common/resource"

	"dsv41-exl3/toolchain/command/internal/common"
)

// Logging is command:local:Logging.
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

// DefaultInterpreter runs the command text.
var DefaultInterpreter = []string{"/bin/sh", "-c"}

// Command is command:local:Command.
type Command struct{}

var (
	_ infer.CustomResource[CommandInputs, CommandOutputs] = (*Command)(nil)
	_ infer.CustomUpdate[CommandInputs, CommandOutputs]   = (*Command)(nil)
	_ infer.CustomDelete[CommandOutputs]                  = (*Command)(nil)
	_ infer.CustomCheck[CommandInputs]                    = (*Command)(nil)
)

func (c *Command) Annotate(a infer.Annotator) {
	a.Describe(c, "A local command to be executed.")
	a.SetToken("local", "Command")
}

// CommandInputs are the inputs of command:local:Command.
type CommandInputs struct {
	Triggers               []any             `pulumi:"triggers,optional" provider:"replaceOnChanges"`
	Create                 *string           `pulumi:"create,optional"`
	Delete                 *string           `pulumi:"delete,optional"`
	Update                 *string           `pulumi:"update,optional"`
	Stdin                  *string           `pulumi:"stdin,optional"`
	Logging                *Logging          `pulumi:"logging,optional"`
	Environment            map[string]string `pulumi:"environment,optional"`
	Dir                    *string           `pulumi:"dir,optional"`
	Interpreter            []string          `pulumi:"interpreter,optional"`
	AddPreviousOutputInEnv *bool             `pulumi:"addPreviousOutputInEnv,optional"`
	AssetPaths             []string          `pulumi:"assetPaths,optional"`
	ArchivePaths           []string          `pulumi:"archivePaths,optional"`
}

func (c *CommandInputs) Annotate(a infer.Annotator) {
	a.Describe(&c.Triggers, "Trigger a resource replacement on changes to any of these values.")
	a.Describe(&c.Create, "The command to run once on resource creation (and on updates when `update` is not set).")
	a.Describe(&c.Delete, "The command to run on resource deletion, with the previous outputs in PULUMI_COMMAND_STDOUT/STDERR.")
	a.Describe(&c.Update, "The command to run when the resource's inputs change; `create` runs when it is not set.")
	a.Describe(&c.Stdin, "Pass a string to the command's process as standard in.")
	a.Describe(&c.Logging, "If the command's stdout and stderr should be logged. Defaults to logging both.")
	a.Describe(&c.Environment, "Additional environment variables available to the command's process.")
	a.Describe(&c.Dir, "The directory from which to run the command. If it does not exist, the command fails.")
	a.Describe(&c.Interpreter, "The program and arguments to run the command. Defaults to [\"/bin/sh\", \"-c\"].")
	a.Describe(&c.AddPreviousOutputInEnv, "If the previous command's stdout and stderr are injected into the "+
		"environment of the next run as PULUMI_COMMAND_STDOUT and PULUMI_COMMAND_STDERR. Defaults to true.")
	a.SetDefault(&c.AddPreviousOutputInEnv, true)
	a.Describe(&c.AssetPaths, "Path globs (relative to dir; \"!\" excludes) of files to return as `assets` after the command.")
	a.Describe(&c.ArchivePaths, "Path globs (relative to dir; \"!\" excludes) of files to return as one `archive` after the command.")
}

// CommandOutputs are the inputs plus stdout, stderr, assets and archive.
type CommandOutputs struct {
	CommandInputs
	Stdout  string                     `pulumi:"stdout"`
	Stderr  string                     `pulumi:"stderr"`
	Assets  map[string]*resource.Asset `pulumi:"assets,optional"`
	Archive *resource.Archive          `pulumi:"archive,optional"`
}

func (c *CommandOutputs) Annotate(a infer.Annotator) {
	a.Describe(&c.Stdout, "The standard output of the command's process")
	a.Describe(&c.Stderr, "The standard error of the command's process")
	a.Describe(&c.Assets, "The files matched by assetPaths, by relative path.")
	a.Describe(&c.Archive, "An archive of the files matched by archivePaths.")
}

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
	err = state.run(ctx, "create", *state.Create, true)
	return infer.CreateResponse[CommandOutputs]{ID: id, Output: state}, err
}

func (*Command) Update(ctx context.Context, req infer.UpdateRequest[CommandInputs, CommandOutputs]) (
	infer.UpdateResponse[CommandOutputs], error) {
	state := req.State
	state.CommandInputs = req.Inputs
	if req.DryRun {
		return infer.UpdateResponse[CommandOutputs]{Output: state}, nil
	}
	op, cmd := "update", req.Inputs.Update
	if cmd == nil {
		op, cmd = "create", req.Inputs.Create
	}
	if cmd == nil {
		return infer.UpdateResponse[CommandOutputs]{Output: state}, nil
	}
	err := state.run(ctx, op, *cmd, true)
	return infer.UpdateResponse[CommandOutputs]{Output: state}, err
}

func (*Command) Delete(ctx context.Context, req infer.DeleteRequest[CommandOutputs]) (infer.DeleteResponse, error) {
	if req.State.Delete == nil {
		return infer.DeleteResponse{}, nil
	}
	state := req.State
	return infer.DeleteResponse{}, state.run(ctx, "delete", *state.Delete, false)
}

func (c *CommandOutputs) workDir() (string, error) {
	if c.Dir != nil && *c.Dir != "" {
		return *c.Dir, nil
	}
	return os.Getwd()
}

// run executes cmd; on success it records stdout/stderr (and assets/archive when collect is set).
func (c *CommandOutputs) run(ctx context.Context, op, command string, collect bool) error {
	log := p.GetLogger(ctx)
	interp := c.Interpreter
	if len(interp) == 0 {
		interp = DefaultInterpreter
	}
	args := append(append([]string(nil), interp[1:]...), command)
	cmd := exec.CommandContext(ctx, interp[0], args...)
	cmd.Cancel = func() error { return cmd.Process.Signal(syscall.SIGTERM) }
	cmd.WaitDelay = 10 * time.Second
	if c.Dir != nil && *c.Dir != "" {
		cmd.Dir = *c.Dir
	}
	cmd.Env = common.ExecEnv(os.Environ(), c.Environment, c.AddPreviousOutputInEnv, c.Stdout, c.Stderr)
	if c.Stdin != nil && *c.Stdin != "" {
		cmd.Stdin = strings.NewReader(*c.Stdin)
	}
	var stdout, stderr bytes.Buffer
	lines := common.NewLineWriter(func(s string) { log.Info(s) })
	mode := logMode(c.Logging)
	cmd.Stdout, cmd.Stderr = io.Writer(&stdout), io.Writer(&stderr)
	if common.ShouldLogStdout(mode) {
		cmd.Stdout = io.MultiWriter(&stdout, lines)
	}
	if common.ShouldLogStderr(mode) {
		cmd.Stderr = io.MultiWriter(&stderr, lines)
	}
	err := cmd.Run()
	lines.Flush()
	if err != nil {
		var exit *exec.ExitError
		if errors.As(err, &exit) && exit.ExitCode() >= 0 {
			err = fmt.Errorf("exit status %d", exit.ExitCode())
		}
		return common.CommandError(op, err, stdout.String(), stderr.String())
	}
	c.Stdout, c.Stderr = common.TrimOutput(stdout.String()), common.TrimOutput(stderr.String())
	if collect {
		return c.collect()
	}
	return nil
}

func (c *CommandOutputs) collect() error {
	c.Assets, c.Archive = nil, nil
	if len(c.AssetPaths) == 0 && len(c.ArchivePaths) == 0 {
		return nil
	}
	dir, err := c.workDir()
	if err != nil {
		return err
	}
	abs, err := filepath.Abs(dir)
	if err != nil {
		return err
	}
	if files, err := common.GlobFiles(abs, c.AssetPaths); err != nil {
		return fmt.Errorf("assetPaths: %w", err)
	} else if len(files) > 0 {
		c.Assets = map[string]*resource.Asset{}
		for _, f := range files {
			a, err := resource.NewPathAsset(filepath.Join(abs, filepath.FromSlash(f)))
			if err != nil {
				return fmt.Errorf("assetPaths: %w", err)
			}
			c.Assets[f] = a
		}
	}
	if files, err := common.GlobFiles(abs, c.ArchivePaths); err != nil {
		return fmt.Errorf("archivePaths: %w", err)
	} else if len(files) > 0 {
		m := map[string]any{}
		for _, f := range files {
			a, err := resource.NewPathAsset(filepath.Join(abs, filepath.FromSlash(f)))
			if err != nil {
				return fmt.Errorf("archivePaths: %w", err)
			}
			m[f] = a
		}
		ar, err := resource.NewAssetArchive(m)
		if err != nil {
			return fmt.Errorf("archivePaths: %w", err)
		}
		c.Archive = ar
	}
	return nil
}

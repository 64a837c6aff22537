// Package common holds the pure parts shared by the local and remote commands: environment
// rendering, output logging decisions, output capture and error texts.
package common

import (
	"bytes"
	"fmt"
	"sort"
	"strings"
	"sync"
)

// Environment variables that carry the previous create/update outputs into the next run.
const (
	EnvStdout = "PULUMI_COMMAND_STDOUT"
	EnvStderr = "PULUMI_COMMAND_STDERR"
)

// EnvVar is one variable, in the order it is sent.
type EnvVar struct {
	Key   string
	Value string
}

// SortedEnv renders a map as variables sorted by key (deterministic order for ssh Setenv and exec).
func SortedEnv(env map[string]string) []EnvVar {
	out := make([]EnvVar, 0, len(env))
	for k, v := range env {
		out = append(out, EnvVar{k, v})
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Key < out[j].Key })
	return out
}

// AddPrevious resolves the addPreviousOutputInEnv input: unset means true.
func AddPrevious(flag *bool) bool { return flag == nil || *flag }

// PreviousOutputEnv returns PULUMI_COMMAND_STDOUT/STDERR for the previous outputs when the flag allows
// it. Empty outputs are not sent (as upstream).
func PreviousOutputEnv(flag *bool, stdout, stderr string) []EnvVar {
	if !AddPrevious(flag) {
		return nil
	}
	var out []EnvVar
	if stdout != "" {
		out = append(out, EnvVar{EnvStdout, stdout})
	}
	if stderr != "" {
		out = append(out, EnvVar{EnvStderr, stderr})
	}
	return out
}

// ExecEnv renders the full environment of a local command: the provider's own environment, then the
// resource's variables, then the previous outputs. Later entries win (exec uses the last duplicate).
func ExecEnv(base []string, env map[string]string, flag *bool, stdout, stderr string) []string {
	out := append([]string(nil), base...)
	for _, v := range SortedEnv(env) {
		out = append(out, v.Key+"="+v.Value)
	}
	for _, v := range PreviousOutputEnv(flag, stdout, stderr) {
		out = append(out, v.Key+"="+v.Value)
	}
	return out
}

// Logging modes (the `logging` input of both Command resources).
const (
	LogStdout          = "stdout"
	LogStderr          = "stderr"
	LogStdoutAndStderr = "stdoutAndStderr"
	LogNone            = "none"
)

// ValidLogging reports whether mode is one of the four values; "" (unset) is valid.
func ValidLogging(mode string) bool {
	switch mode {
	case "", LogStdout, LogStderr, LogStdoutAndStderr, LogNone:
		return true
	}
	return false
}

// ShouldLogStdout: unset logs both streams.
func ShouldLogStdout(mode string) bool {
	return mode == "" || mode == LogStdout || mode == LogStdoutAndStderr
}

// ShouldLogStderr: unset logs both streams.
func ShouldLogStderr(mode string) bool {
	return mode == "" || mode == LogStderr || mode == LogStdoutAndStderr
}

// TrimOutput removes one trailing newline, as upstream does for the stdout/stderr outputs.
func TrimOutput(s string) string { return strings.TrimSuffix(s, "\n") }

// maxErrorOutput bounds the command output quoted in an error message.
const maxErrorOutput = 8 << 10

func tail(s string) string {
	s = strings.TrimRight(s, "\n")
	if len(s) <= maxErrorOutput {
		return s
	}
	return "..." + s[len(s)-maxErrorOutput:]
}

// CommandError is the error of a failed run: which operation, the exit status (or other failure) and
// the command's stderr (and stdout when there is some), tails only.
func CommandError(op string, cause error, stdout, stderr string) error {
	var b strings.Builder
	fmt.Fprintf(&b, "%s command failed: %v", op, cause)
	fmt.Fprintf(&b, "\nstderr:\n%s", tail(stderr))
	if strings.TrimSpace(stdout) != "" {
		fmt.Fprintf(&b, "\nstdout:\n%s", tail(stdout))
	}
	return fmt.Errorf("%s", b.String())
}

// LineWriter sends complete lines to emit as they arrive; Flush sends a trailing partial line.
// It is safe for concurrent writers (stdout and stderr may share one).
type LineWriter struct {
	mu   sync.Mutex
	buf  []byte
	emit func(string)
}

// NewLineWriter returns a writer emitting each line (without its newline).
func NewLineWriter(emit func(string)) *LineWriter { return &LineWriter{emit: emit} }

const maxLine = 64 << 10

func (w *LineWriter) Write(p []byte) (int, error) {
	w.mu.Lock()
	defer w.mu.Unlock()
	w.buf = append(w.buf, p...)
	for {
		i := bytes.IndexByte(w.buf, '\n')
		if i < 0 {
			break
		}
		w.emit(strings.TrimSuffix(string(w.buf[:i]), "\r"))
		w.buf = w.buf[i+1:]
	}
	if len(w.buf) > maxLine {
		w.emit(string(w.buf))
		w.buf = nil
	}
	return len(p), nil
}

// Flush emits what is left without a newline.
func (w *LineWriter) Flush() {
	w.mu.Lock()
	defer w.mu.Unlock()
	if len(w.buf) > 0 {
		w.emit(string(w.buf))
		w.buf = nil
	}
}

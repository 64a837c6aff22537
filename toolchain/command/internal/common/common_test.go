package common

import (
	"errors"
	"reflect"
	"strings"
	"testing"

	p "github.com/pulumi/pulumi-go-provider"
)

func ptr[T any](v T) *T { return &v }

func TestSortedEnv(t *testing.T) {
	got := SortedEnv(map[string]string{"B": "2", "A": "1", "C": ""})
	want := []EnvVar{{"A", "1"}, {"B", "2"}, {"C", ""}}
	if !reflect.DeepEqual(got, want) {
		t.Fatalf("SortedEnv = %v, want %v", got, want)
	}
}

func TestPreviousOutputEnv(t *testing.T) {
	cases := []struct {
		name           string
		flag           *bool
		stdout, stderr string
		want           []EnvVar
	}{
		{"unset means true", nil, "out", "err", []EnvVar{{EnvStdout, "out"}, {EnvStderr, "err"}}},
		{"true", ptr(true), "out", "", []EnvVar{{EnvStdout, "out"}}},
		{"false sends nothing", ptr(false), "out", "err", nil},
		{"empty outputs are not sent", nil, "", "", nil},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			if got := PreviousOutputEnv(c.flag, c.stdout, c.stderr); !reflect.DeepEqual(got, c.want) {
				t.Fatalf("got %v, want %v", got, c.want)
			}
		})
	}
}

func TestExecEnvOrderLetsResourceAndPreviousOutputsWin(t *testing.T) {
	got := ExecEnv([]string{"PATH=/bin", "X=base"}, map[string]string{"X": "mine", "A": "a"}, nil, "prev", "")
	want := []string{"PATH=/bin", "X=base", "A=a", "X=mine", EnvStdout + "=prev"}
	if !reflect.DeepEqual(got, want) {
		t.Fatalf("ExecEnv = %v, want %v", got, want)
	}
	if got := ExecEnv(nil, nil, ptr(false), "prev", "e"); len(got) != 0 {
		t.Fatalf("addPreviousOutputInEnv=false still sent %v", got)
	}
}

func TestLoggingModes(t *testing.T) {
	cases := map[string][2]bool{
		"":                 {true, true},
		LogStdout:          {true, false},
		LogStderr:          {false, true},
		LogStdoutAndStderr: {true, true},
		LogNone:            {false, false},
	}
	for mode, want := range cases {
		if got := [2]bool{ShouldLogStdout(mode), ShouldLogStderr(mode)}; got != want {
			t.Errorf("logging %q: (stdout, stderr) = %v, want %v", mode, got, want)
		}
		if !ValidLogging(mode) {
			t.Errorf("%q should be valid", mode)
		}
	}
	if ValidLogging("both") {
		t.Error(`"both" should be invalid`)
	}
}

func TestCommandErrorCarriesStatusAndStderr(t *testing.T) {
	err := CommandError("update", errors.New("exit status 3"), "some stdout\n", "boom: disk full\n")
	msg := err.Error()
	for _, want := range []string{"update command failed", "exit status 3", "boom: disk full", "some stdout"} {
		if !strings.Contains(msg, want) {
			t.Errorf("error %q lacks %q", msg, want)
		}
	}
	long := strings.Repeat("x", 3*maxErrorOutput) + "END"
	if msg := CommandError("create", errors.New("exit status 1"), "", long).Error(); len(msg) > maxErrorOutput+200 ||
		!strings.HasSuffix(msg, "END") {
		t.Errorf("long stderr is not cut to its tail: %d chars", len(msg))
	}
}

func TestTrimOutput(t *testing.T) {
	if got := TrimOutput("a\n\n"); got != "a\n" {
		t.Fatalf("TrimOutput removes one newline only, got %q", got)
	}
}

func TestLineWriter(t *testing.T) {
	var lines []string
	w := NewLineWriter(func(s string) { lines = append(lines, s) })
	_, _ = w.Write([]byte("one\ntw"))
	_, _ = w.Write([]byte("o\r\nthree"))
	if !reflect.DeepEqual(lines, []string{"one", "two"}) {
		t.Fatalf("lines before flush = %v", lines)
	}
	w.Flush()
	if !reflect.DeepEqual(lines, []string{"one", "two", "three"}) {
		t.Fatalf("lines after flush = %v", lines)
	}
}

func TestMatchRulesUpstreamExample(t *testing.T) {
	paths := []string{"assets/logos/logo.svg", "src/index.js", "src/secret.js", "README.md"}
	got, err := MatchRules([]string{"assets/**", "src/**.js", "!**secret.*"}, paths)
	if err != nil {
		t.Fatal(err)
	}
	want := []string{"assets/logos/logo.svg", "src/index.js"}
	if !reflect.DeepEqual(got, want) {
		t.Fatalf("MatchRules = %v, want %v", got, want)
	}
}

func TestGlobStarDoesNotCrossSlash(t *testing.T) {
	got, err := MatchRules([]string{"*.txt", "{a,b}/?.md"}, []string{"x.txt", "d/y.txt", "a/1.md", "b/2.md", "c/3.md"})
	if err != nil {
		t.Fatal(err)
	}
	if want := []string{"a/1.md", "b/2.md", "x.txt"}; !reflect.DeepEqual(got, want) {
		t.Fatalf("got %v, want %v", got, want)
	}
	if _, err := MatchRules([]string{"{a,b"}, nil); err == nil {
		t.Fatal("unterminated { accepted")
	}
}

func TestForceReplacesNestedTriggerChanges(t *testing.T) {
	d := p.DiffResponse{HasChanges: true, DetailedDiff: map[string]p.PropertyDiff{
		"triggers[0]":   {Kind: p.Update},
		"triggers[2].a": {Kind: p.Add},
		"triggers":      {Kind: p.Delete},
		"create":        {Kind: p.Update},
		"connection":    {Kind: p.Update},
		"triggersx":     {Kind: p.Update},
	}}
	got := ForceReplaces(d, ReplaceProperties).DetailedDiff
	want := map[string]p.DiffKind{
		"triggers[0]": p.UpdateReplace, "triggers[2].a": p.AddReplace, "triggers": p.DeleteReplace,
		"create": p.Update, "connection": p.Update, "triggersx": p.Update,
	}
	for k, kind := range want {
		if got[k].Kind != kind {
			t.Errorf("%s: kind %s, want %s", k, got[k].Kind, kind)
		}
	}
}

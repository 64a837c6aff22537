package main

import (
	"context"
	"testing"

	"github.com/blang/semver"
	p "github.com/pulumi/pulumi-go-provider"
	"github.com/pulumi/pulumi-go-provider/integration"
	presource "github.com/pulumi/pulumi/sdk/v3/go/common/resource"
	"github.com/pulumi/pulumi/sdk/v3/go/property"
)

func server(t *testing.T) integration.Server {
	t.Helper()
	prov, err := Provider()
	if err != nil {
		t.Fatal(err)
	}
	s, err := integration.NewServer(context.Background(), "command", semver.MustParse("1.2.1"),
		integration.WithProvider(prov))
	if err != nil {
		t.Fatal(err)
	}
	return s
}

const remoteURN = presource.URN("urn:pulumi:dev::proj::command:remote:Command::c")

func conn() property.Value {
	return property.New(map[string]property.Value{"host": property.New("10.0.0.1")})
}

func remoteInputs(create string, triggers ...string) property.Map {
	m := map[string]property.Value{
		"connection": conn(),
		"create":     property.New(create),
	}
	if len(triggers) > 0 {
		arr := []property.Value{}
		for _, tr := range triggers {
			arr = append(arr, property.New(tr))
		}
		m["triggers"] = property.New(arr)
	}
	return property.NewMap(m)
}

// state is what a create would have stored: the checked inputs plus outputs.
func state(t *testing.T, s integration.Server, in property.Map) property.Map {
	t.Helper()
	checked, err := s.Check(p.CheckRequest{Urn: remoteURN, Inputs: in})
	if err != nil || len(checked.Failures) > 0 {
		t.Fatalf("check: %v %v", err, checked.Failures)
	}
	return checked.Inputs.Set("stdout", property.New("out")).Set("stderr", property.New(""))
}

func diff(t *testing.T, s integration.Server, olds, news property.Map) p.DiffResponse {
	t.Helper()
	st := state(t, s, olds)
	checked, err := s.Check(p.CheckRequest{Urn: remoteURN, State: st, Inputs: news})
	if err != nil {
		t.Fatal(err)
	}
	d, err := s.Diff(p.DiffRequest{ID: "c-1", Urn: remoteURN, State: st, Inputs: checked.Inputs})
	if err != nil {
		t.Fatal(err)
	}
	return d
}

func replaces(d p.DiffResponse) []string {
	var out []string
	for k, v := range d.DetailedDiff {
		switch v.Kind {
		case p.AddReplace, p.DeleteReplace, p.UpdateReplace:
			out = append(out, k)
		}
	}
	return out
}

func TestDiffNoChange(t *testing.T) {
	s := server(t)
	d := diff(t, s, remoteInputs("echo hi", "a"), remoteInputs("echo hi", "a"))
	if d.HasChanges {
		t.Fatalf("unchanged inputs show changes: %+v", d.DetailedDiff)
	}
}

func TestDiffTriggersReplace(t *testing.T) {
	s := server(t)
	d := diff(t, s, remoteInputs("echo hi", "a"), remoteInputs("echo hi", "b"))
	if !d.HasChanges || len(replaces(d)) == 0 {
		t.Fatalf("a triggers change must replace: %+v", d.DetailedDiff)
	}
	for _, k := range replaces(d) {
		if k != "triggers" && k[:len("triggers")] != "triggers" {
			t.Errorf("unexpected replace key %q", k)
		}
	}
}

func TestDiffCommandChangeUpdatesInPlace(t *testing.T) {
	s := server(t)
	for name, news := range map[string]property.Map{
		"create": remoteInputs("echo bye", "a"),
		"delete": remoteInputs("echo hi", "a").Set("delete", property.New("rm -f x")),
		"stdin":  remoteInputs("echo hi", "a").Set("stdin", property.New("data")),
	} {
		d := diff(t, s, remoteInputs("echo hi", "a"), news)
		if !d.HasChanges {
			t.Errorf("%s change shows no change", name)
		}
		if r := replaces(d); len(r) > 0 {
			t.Errorf("%s change must update in place, got replaces %v", name, r)
		}
	}
}

func TestCheckAppliesUpstreamDefaults(t *testing.T) {
	s := server(t)
	checked, err := s.Check(p.CheckRequest{Urn: remoteURN, Inputs: remoteInputs("true")})
	if err != nil {
		t.Fatal(err)
	}
	c := checked.Inputs.Get("connection").AsMap()
	if c.Get("port").AsNumber() != 22 || c.Get("user").AsString() != "root" ||
		c.Get("dialErrorLimit").AsNumber() != 10 || c.Get("perDialTimeout").AsNumber() != 15 {
		t.Errorf("connection defaults: %v", c)
	}
	if !checked.Inputs.Get("addPreviousOutputInEnv").AsBool() {
		t.Errorf("addPreviousOutputInEnv should default to true")
	}
}

func TestCheckRejectsUnknownLogging(t *testing.T) {
	s := server(t)
	checked, err := s.Check(p.CheckRequest{Urn: remoteURN,
		Inputs: remoteInputs("true").Set("logging", property.New("both"))})
	if err == nil && len(checked.Failures) == 0 {
		t.Fatal(`logging "both" was accepted`)
	}
}

package common

import (
	"context"
	"strings"

	p "github.com/pulumi/pulumi-go-provider"
)

// ReplaceProperties are the inputs whose change, at any depth, replaces the resource (upstream's
// replaceOnChanges on triggers). infer's default diff looks up replaceOnChanges by the detailed-diff key,
// which for an element change is "triggers[0]", so a nested change would only show as an update.
var ReplaceProperties = map[string]bool{"triggers": true}

// TopLevelProperty is the property a detailed-diff path starts with: "triggers[0].a" -> "triggers".
func TopLevelProperty(path string) string {
	if i := strings.IndexAny(path, ".["); i >= 0 {
		return path[:i]
	}
	return path
}

// asReplace turns a change kind into its replacing form.
func asReplace(k p.DiffKind) p.DiffKind {
	switch k {
	case p.Add:
		return p.AddReplace
	case p.Delete:
		return p.DeleteReplace
	case p.Update:
		return p.UpdateReplace
	}
	return k
}

// ForceReplaces marks every change under a replace property as a replace.
func ForceReplaces(d p.DiffResponse, replace map[string]bool) p.DiffResponse {
	if len(d.DetailedDiff) == 0 {
		return d
	}
	out := make(map[string]p.PropertyDiff, len(d.DetailedDiff))
	for k, v := range d.DetailedDiff {
		if replace[TopLevelProperty(k)] {
			v.Kind = asReplace(v.Kind)
		}
		out[k] = v
	}
	d.DetailedDiff = out
	return d
}

// WithForcedReplaces wraps a provider's Diff with ForceReplaces.
func WithForcedReplaces(prov p.Provider, replace map[string]bool) p.Provider {
	inner := prov.Diff
	if inner == nil {
		return prov
	}
	prov.Diff = func(ctx context.Context, req p.DiffRequest) (p.DiffResponse, error) {
		d, err := inner(ctx, req)
		if err != nil {
			return d, err
		}
		return ForceReplaces(d, replace), nil
	}
	return prov
}

// Package pulumishim is copied into a build-time copy of the upstream module (toolchain/build_docker.sh):
// Go forbids importing internal/provider from another module, so this exports its constructor, with the one
// correction this project makes to the upstream's behaviour (keepDeclaredCapabilities).
package pulumishim

import (
	"context"
	"sort"
	"strings"

	"github.com/hashicorp/terraform-plugin-sdk/v2/diag"
	"github.com/hashicorp/terraform-plugin-sdk/v2/helper/schema"
	"github.com/terraform-providers/terraform-provider-docker/internal/provider"
)

// NewProvider returns the upstream's SDKv2 provider.
func NewProvider(version string) *schema.Provider {
	p := provider.New(version)()
	keepDeclaredCapabilities(p.ResourcesMap["docker_container"])
	return p
}

// keepDeclaredCapabilities: docker reports a container's added and dropped capabilities with the CAP_ prefix
// whatever form they were declared in (IPC_LOCK comes back as CAP_IPC_LOCK), and the upstream read stores
// docker's form (its own "TODO implement DiffSuppressFunc"). Both fields force replacement, so a
// `pulumi refresh` turned every running rank into a replacement at the next up. When docker's answer names
// the same capabilities as the state, the state's form stays; a real difference is stored as docker says.
// Only the read (refresh, import) is wrapped: create reads through the upstream function directly.
func keepDeclaredCapabilities(r *schema.Resource) {
	read := r.ReadContext
	r.ReadContext = func(ctx context.Context, d *schema.ResourceData, meta interface{}) diag.Diagnostics {
		before := d.Get("capabilities")
		diags := read(ctx, d, meta)
		if diags.HasError() || d.Id() == "" {
			return diags
		}
		if canonicalCapabilities(before) == canonicalCapabilities(d.Get("capabilities")) {
			if err := d.Set("capabilities", before); err != nil {
				return append(diags, diag.FromErr(err)...)
			}
		}
		return diags
	}
}

// canonicalCapabilities renders the capabilities block as "add:CAP_A,CAP_B;drop:..." with names upper-cased,
// CAP_-prefixed and sorted: equal strings name the same capabilities.
func canonicalCapabilities(value interface{}) string {
	set, ok := value.(*schema.Set)
	if !ok || set.Len() == 0 {
		return ""
	}
	var parts []string
	for _, item := range set.List() {
		block, ok := item.(map[string]interface{})
		if !ok {
			continue
		}
		for _, key := range []string{"add", "drop"} {
			names := []string{}
			if list, ok := block[key].(*schema.Set); ok {
				for _, name := range list.List() {
					n := strings.ToUpper(strings.TrimSpace(name.(string)))
					if !strings.HasPrefix(n, "CAP_") && n != "ALL" {
						n = "CAP_" + n
					}
					names = append(names, n)
				}
			}
			sort.Strings(names)
			parts = append(parts, key+":"+strings.Join(names, ","))
		}
	}
	sort.Strings(parts)
	return strings.Join(parts, ";")
}

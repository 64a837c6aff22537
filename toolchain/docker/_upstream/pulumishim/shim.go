// Package pulumishim is copied into a build-time copy of the upstream module (toolchain/build_docker.sh):
// Go forbids importing internal/provider from another module, so this exports its constructor.
package pulumishim

import (
	"github.com/hashicorp/terraform-plugin-sdk/v2/helper/schema"
	"github.com/terraform-providers/terraform-provider-docker/internal/provider"
)

// NewProvider returns the upstream's SDKv2 provider.
func NewProvider(version string) *schema.Provider { return provider.New(version)() }

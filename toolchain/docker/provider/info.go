// Package provider maps the upstream Terraform docker provider (kreuzwerker/terraform-provider-docker, the one
// pulumi-docker bridges) onto the Pulumi package `docker`, with the tokens and property names the pinned
// pulumi_docker Python SDK sends. tests/toolchain/test_docker_conformance.py checks them against that SDK.
package provider

import (
	"github.com/pulumi/pulumi-terraform-bridge/v3/pkg/tfbridge"
	"github.com/pulumi/pulumi-terraform-bridge/v3/pkg/tfbridge/tokens"
	shimv2 "github.com/pulumi/pulumi-terraform-bridge/v3/pkg/tfshim/sdk-v2"
	"github.com/terraform-providers/terraform-provider-docker/pulumishim"
)

const pkg = "docker"


// Info is the bridge's description of the provider. Only the SDKv2 half of the upstream is bridged: every
// resource and data source the pinned SDK has lives there (the plugin-framework half holds compose, a
// containers list and registry tag data sources, which the SDK does not know).
func Info(version string) tfbridge.ProviderInfo {
	info := tfbridge.ProviderInfo{
		P:           shimv2.NewProvider(pulumishim.NewProvider(version)),
		Name:        pkg,
		Version:     version,
		DisplayName: "Docker",
		Description: "Docker resources, bridged by dsv41-exl3 from the upstream Terraform provider",
		License:     "Apache-2.0",
		Repository:  "https://github.com/kreuzwerker/terraform-provider-docker",
		Config: map[string]*tfbridge.SchemaInfo{
			"host": {Default: &tfbridge.DefaultInfo{
				Value:   "unix:///var/run/docker.sock",
				EnvVars: []string{"DOCKER_HOST"},
			}},
			// The SDK names this block in the singular.
			"registry_auth": {Name: "registryAuth", MaxItemsOne: tfbridge.False()},
		},
		// Where the SDK's names differ from what automatic mapping would give.
		Resources: map[string]*tfbridge.ResourceInfo{
			"docker_image":  {Tok: "docker:index/remoteImage:RemoteImage", Fields: map[string]*tfbridge.SchemaInfo{"name": {Name: "name"}}},
			"docker_config": {Tok: "docker:index/serviceConfig:ServiceConfig"},
			"docker_container": {
				Tok: "docker:index/container:Container",
				// Containers have fixed names: the old one must be gone before its replacement is created.
				DeleteBeforeReplace: true,
				Fields: map[string]*tfbridge.SchemaInfo{
					"command":           {Name: "command"},
					"networks_advanced": {Name: "networksAdvanced"},
				},
			},
		},
		DataSources: map[string]*tfbridge.DataSourceInfo{
			"docker_image": {Tok: "docker:index/getRemoteImage:getRemoteImage"},
		},
		Python: &tfbridge.PythonInfo{},
	}
	info.MustComputeTokens(tokens.SingleModule("docker_", "index", tokens.MakeStandard(pkg)))
	info.SetAutonaming(255, "-")
	return info
}

// pulumi-tfgen-docker generates the Pulumi schema of the bridged provider (`pulumi-tfgen-docker schema --out DIR`).
package main

import (
	"github.com/pulumi/pulumi-terraform-bridge/v3/pkg/tfgen"

	"dsv41-exl3/toolchain/docker/provider"
)

var version = "0.0.0-dev" // stamped by the build (-X main.version=...)

func main() { tfgen.Main("docker", version, provider.Info(version)) }

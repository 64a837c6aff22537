// Command pulumi-resource-command serves the Pulumi package `command` (local:Command, remote:Command,
// remote:CopyToRemote) with the wire shape of pulumi_command 1.2.1, on pulumi-go-provider's infer.
package main

import (
	"context"
	"fmt"
	"os"

	p "github.com/pulumi/pulumi-go-provider"
	"github.com/pulumi/pulumi-go-provider/infer"

	"dsv41-exl3/toolchain/command/internal/common"
	"dsv41-exl3/toolchain/command/local"
	"dsv41-exl3/toolchain/command/remote"
)

// Version is stamped at build time: -ldflags "-X main.Version=1.2.1".
var Version = "0.0.0-dev"

// SourceHash is stamped at build time (toolchain/build_command.sh) so a rebuild is skipped only when
// the sources are unchanged.
var SourceHash = ""

// Provider builds the provider; exported for tests.
func Provider() (p.Provider, error) {
	prov, err := infer.NewProviderBuilder().
		WithDisplayName("Command").
		WithDescription("Runs commands locally or on remote hosts over ssh (compatible with pulumi-command 1.2.1).").
		WithResources(
			infer.Resource(&local.Command{}),
			infer.Resource(&remote.Command{}),
			infer.Resource(&remote.CopyToRemote{}),
		).
		Build()
	if err != nil {
		return p.Provider{}, err
	}
	return common.WithForcedReplaces(prov, common.ReplaceProperties), nil
}

func main() {
	if len(os.Args) == 2 {
		switch os.Args[1] {
		case "--version", "-version", "version":
			fmt.Println(Version)
			return
		case "--source-hash":
			fmt.Println(SourceHash)
			return
		}
	}
	prov, err := Provider()
	if err == nil {
		err = p.RunProvider(context.Background(), "command", Version, prov)
	}
	if err != nil {
		fmt.Fprintf(os.Stderr, "pulumi-resource-command: %v\n", err)
		os.Exit(1)
	}
}

package remote

import (
	"context"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path"
	"path/filepath"
	"strings"

	"github.com/pkg/sftp"
	p "github.com/pulumi/pulumi-go-provider"
	"github.com/pulumi/pulumi-go-provider/infer"
	"github.com/pulumi/pulumi-go-provider/infer/types"
	"github.com/pulumi/pulumi/sdk/v3/go/common/resource"
)

// CopyToRemote is command:remote:CopyToRemote.
type CopyToRemote struct{}

var (
	_ infer.CustomResource[CopyToRemoteInputs, CopyToRemoteOutputs] = (*CopyToRemote)(nil)
	_ infer.CustomUpdate[CopyToRemoteInputs, CopyToRemoteOutputs]   = (*CopyToRemote)(nil)
)

func (c *CopyToRemote) Annotate(a infer.Annotator) {
	a.Describe(c, "Copy an Asset or Archive (FileAsset, StringAsset, FileArchive) to a remote host over SFTP.")
	a.SetToken("remote", "CopyToRemote")
}

// CopyToRemoteInputs are the inputs of command:remote:CopyToRemote.
type CopyToRemoteInputs struct {
	Connection Connection           `pulumi:"connection" provider:"secret"`
	Triggers   []any                `pulumi:"triggers,optional" provider:"replaceOnChanges"`
	Source     types.AssetOrArchive `pulumi:"source"`
	RemotePath string               `pulumi:"remotePath"`
}

func (c *CopyToRemoteInputs) Annotate(a infer.Annotator) {
	a.Describe(&c.Connection, "The parameters with which to connect to the remote host.")
	a.Describe(&c.Triggers, "Trigger replacements on changes to this input.")
	a.Describe(&c.Source, "An asset or an archive to upload as the source of the copy: a FileAsset, a StringAsset or a FileArchive.")
	a.Describe(&c.RemotePath, "The destination path on the remote host. Parent directories are created. "+
		"An existing directory receives the source inside it.")
}

// CopyToRemoteOutputs mirror the inputs.
type CopyToRemoteOutputs struct {
	CopyToRemoteInputs
}

func (*CopyToRemote) Create(ctx context.Context, req infer.CreateRequest[CopyToRemoteInputs]) (
	infer.CreateResponse[CopyToRemoteOutputs], error) {
	out := CopyToRemoteOutputs{req.Inputs}
	id, err := resource.NewUniqueHex(req.Name, 8, 0)
	if err != nil {
		return infer.CreateResponse[CopyToRemoteOutputs]{}, err
	}
	if !req.DryRun {
		err = copyToRemote(ctx, &req.Inputs)
	}
	return infer.CreateResponse[CopyToRemoteOutputs]{ID: id, Output: out}, err
}

func (*CopyToRemote) Update(ctx context.Context, req infer.UpdateRequest[CopyToRemoteInputs, CopyToRemoteOutputs]) (
	infer.UpdateResponse[CopyToRemoteOutputs], error) {
	out := CopyToRemoteOutputs{req.Inputs}
	if req.DryRun {
		return infer.UpdateResponse[CopyToRemoteOutputs]{Output: out}, nil
	}
	return infer.UpdateResponse[CopyToRemoteOutputs]{Output: out}, copyToRemote(ctx, &req.Inputs)
}

// sourceKind describes what will be copied: text, a local file, or a local directory.
type copySource struct {
	text    *string
	file    string
	dir     string
	display string
}

func resolveSource(src types.AssetOrArchive) (copySource, error) {
	switch {
	case src.Asset != nil && src.Archive != nil:
		return copySource{}, errors.New("source: both an asset and an archive are set")
	case src.Asset != nil:
		a := src.Asset
		switch {
		case a.IsText():
			t := a.Text
			return copySource{text: &t, display: "StringAsset"}, nil
		case a.IsPath():
			return copySource{file: a.Path, display: a.Path}, nil
		default:
			return copySource{}, fmt.Errorf("source: only FileAsset and StringAsset are supported, got a remote asset %q", a.URI)
		}
	case src.Archive != nil:
		a := src.Archive
		if !a.IsPath() {
			return copySource{}, errors.New("source: only FileArchive is supported for archives")
		}
		st, err := os.Stat(a.Path)
		if err != nil {
			return copySource{}, fmt.Errorf("source: %w", err)
		}
		if st.IsDir() {
			return copySource{dir: a.Path, display: a.Path}, nil
		}
		// Archive files (.tgz, .zip...) are copied as they are, not unpacked.
		return copySource{file: a.Path, display: a.Path}, nil
	}
	return copySource{}, errors.New("source: no asset or archive given")
}

func copyToRemote(ctx context.Context, in *CopyToRemoteInputs) error {
	src, err := resolveSource(in.Source)
	if err != nil {
		return err
	}
	client, err := in.Connection.Dial(ctx)
	if err != nil {
		return err
	}
	defer client.Close()
	sc, err := sftp.NewClient(client.Client)
	if err != nil {
		return fmt.Errorf("sftp: %w", err)
	}
	defer sc.Close()
	p.GetLogger(ctx).InfoStatusf("copying %s to %s", src.display, in.RemotePath)

	dest := in.RemotePath
	st, statErr := sc.Stat(dest)
	destIsDir := statErr == nil && st.IsDir()
	switch {
	case src.text != nil:
		if destIsDir {
			return fmt.Errorf("remotePath %s is a directory; a StringAsset needs a file path", dest)
		}
		return writeRemote(sc, dest, strings.NewReader(*src.text), 0o644)
	case src.file != "":
		if destIsDir {
			dest = path.Join(dest, filepath.Base(src.file))
		}
		return copyFile(sc, src.file, dest)
	default:
		if statErr == nil && !destIsDir {
			return fmt.Errorf("remotePath %s is an existing file; cannot copy the directory %s onto it", dest, src.dir)
		}
		if destIsDir {
			dest = path.Join(dest, filepath.Base(filepath.Clean(src.dir)))
		}
		return copyDir(sc, src.dir, dest)
	}
}

func writeRemote(sc *sftp.Client, dest string, r io.Reader, mode fs.FileMode) error {
	if err := sc.MkdirAll(path.Dir(dest)); err != nil {
		return fmt.Errorf("sftp mkdir %s: %w", path.Dir(dest), err)
	}
	f, err := sc.OpenFile(dest, os.O_WRONLY|os.O_CREATE|os.O_TRUNC)
	if err != nil {
		return fmt.Errorf("sftp open %s: %w", dest, err)
	}
	if _, err := f.ReadFrom(r); err != nil {
		_ = f.Close()
		return fmt.Errorf("sftp write %s: %w", dest, err)
	}
	if err := f.Close(); err != nil {
		return fmt.Errorf("sftp close %s: %w", dest, err)
	}
	if err := sc.Chmod(dest, mode.Perm()); err != nil {
		return fmt.Errorf("sftp chmod %s: %w", dest, err)
	}
	return nil
}

func copyFile(sc *sftp.Client, local, dest string) error {
	f, err := os.Open(local)
	if err != nil {
		return err
	}
	defer f.Close()
	st, err := f.Stat()
	if err != nil {
		return err
	}
	return writeRemote(sc, dest, f, st.Mode())
}

func copyDir(sc *sftp.Client, local, dest string) error {
	return filepath.WalkDir(local, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		rel, err := filepath.Rel(local, p)
		if err != nil {
			return err
		}
		target := path.Join(dest, filepath.ToSlash(rel))
		switch {
		case d.IsDir():
			if err := sc.MkdirAll(target); err != nil {
				return fmt.Errorf("sftp mkdir %s: %w", target, err)
			}
			return nil
		case d.Type().IsRegular():
			return copyFile(sc, p, target)
		default:
			return nil // symlinks, sockets...: skipped
		}
	})
}

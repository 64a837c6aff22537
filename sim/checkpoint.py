"""The small, deterministic checkpoint the hub stand-in serves (pure data, stdlib only).

Same names and counts as the real repos, a few KiB per file:
- the EXL3 repo: 39 shards `model-000NN-of-00039.safetensors`, their index, config and tokenizer files;
- the base repo: all 48 shards `model-000NN-of-00048.safetensors`, an index naming all 48, config.json and a
  README (which staging must not fetch).
Every shard is a valid safetensors file (one U8 tensor), so a loader that parses headers accepts it.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import struct
from pathlib import Path

MODEL_REPO = "Mia-AiLab/DeepSeek-V4.1-Flash-EXL3-2.9bpw"
BASE_REPO = "deepseek-ai/DeepSeek-V4.1-Flash"
MODEL_SHARDS = 39
BASE_SHARDS = 48
INDEX = "model.safetensors.index.json"

Repo = dict[str, bytes]


def shard_name(index: int, total: int) -> str:
    return f"model-{index:05d}-of-{total:05d}.safetensors"


def _payload(seed: str, size: int) -> bytes:
    """`size` pseudo-random bytes, the same on every machine and run."""
    out = bytearray()
    counter = 0
    while len(out) < size:
        out += hashlib.sha256(f"{seed}:{counter}".encode()).digest()
        counter += 1
    return bytes(out[:size])


def safetensors_file(tensor: str, data: bytes, metadata: dict[str, str]) -> bytes:
    """One U8 tensor in the safetensors layout: u64 header length, JSON header (space-padded to 8), data."""
    header = json.dumps({"__metadata__": metadata,
                         tensor: {"dtype": "U8", "shape": [len(data)], "data_offsets": [0, len(data)]}},
                        separators=(",", ":")).encode()
    header += b" " * (-len(header) % 8)
    return struct.pack("<Q", len(header)) + header + data


def _json(obj: object) -> bytes:
    return (json.dumps(obj, indent=2, sort_keys=True) + "\n").encode()


def _shards(repo: str, total: int, base_size: int, step: int, fmt: str) -> tuple[Repo, dict[str, str]]:
    files: Repo = {}
    weight_map: dict[str, str] = {}
    for i in range(1, total + 1):
        name = shard_name(i, total)
        tensor = f"model.layers.{i - 1}.weight"
        files[name] = safetensors_file(tensor, _payload(f"{repo}/{name}", base_size + step * i), {"format": fmt})
        weight_map[tensor] = name
    return files, weight_map


def model_repo() -> Repo:
    files, weight_map = _shards(MODEL_REPO, MODEL_SHARDS, 2048, 97, "exl3")
    total = sum(len(d) for d in files.values())
    files[INDEX] = _json({"metadata": {"total_size": total}, "weight_map": weight_map})
    files["config.json"] = _json({
        "architectures": ["DeepseekV4ForCausalLM"], "model_type": "deepseek_v4", "hidden_size": 64,
        "num_hidden_layers": MODEL_SHARDS, "vocab_size": 256, "max_position_embeddings": 1048576,
        "torch_dtype": "bfloat16",
        "quantization_config": {"quant_method": "exl3", "bits": 2.9, "head_bits": 6},
    })
    files["generation_config.json"] = _json({"bos_token_id": 0, "eos_token_id": 1})
    files["tokenizer_config.json"] = _json({"bos_token": "<s>", "eos_token": "</s>", "model_max_length": 1048576})
    files["tokenizer.json"] = _json({"version": "1.0", "model": {"type": "BPE", "vocab": {"<s>": 0, "</s>": 1}}})
    return files


def base_repo() -> Repo:
    files, weight_map = _shards(BASE_REPO, BASE_SHARDS, 1024, 31, "pt")
    total = sum(len(d) for d in files.values())
    files[INDEX] = _json({"metadata": {"total_size": total}, "weight_map": weight_map})
    files["config.json"] = _json({"architectures": ["DeepseekV4ForCausalLM"], "model_type": "deepseek_v4",
                                  "num_hidden_layers": BASE_SHARDS, "torch_dtype": "bfloat16"})
    files["README.md"] = b"# DeepSeek-V4.1-Flash (simulated)\n"
    return files


def build() -> dict[str, Repo]:
    """{repo id: {path: content}} for both repos."""
    return {MODEL_REPO: model_repo(), BASE_REPO: base_repo()}


def blob_oid(data: bytes) -> str:
    """The git blob id of `data`, what the hub lists as a file's oid."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def is_lfs(path: str) -> bool:
    """Stored in git LFS on the hub (the real repos' .gitattributes track *.safetensors)."""
    return path.endswith(".safetensors")


def lfs_pointer(data: bytes) -> bytes:
    """The git LFS pointer file git stores for `data`; its blob id is what the hub lists as an LFS file's oid."""
    return (f"version https://git-lfs.github.com/spec/v1\noid sha256:{hashlib.sha256(data).hexdigest()}\n"
            f"size {len(data)}\n").encode()


def repo_commit(files: Repo) -> str:
    """A 40-hex commit id that changes whenever any file does."""
    h = hashlib.sha1()
    for path in sorted(files):
        h.update(f"{path}\0{blob_oid(files[path])}\n".encode())
    return h.hexdigest()


def write(dest: Path) -> None:
    """Write both repos under dest/<org>/<name>/ (for inspection; the hub serves from memory)."""
    for repo, files in build().items():
        for path, data in files.items():
            target = dest / repo / path
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(data)


def main() -> None:
    parser = argparse.ArgumentParser(description="Write the simulated checkpoint to a directory.")
    parser.add_argument("dest", type=Path)
    write(parser.parse_args().dest)


if __name__ == "__main__":
    main()

"""The small, deterministic checkpoint the hub stand-in serves (pure data, stdlib only).

Same names and counts as the real repos:
- the EXL3 repo: a real, random-weight tiny Llama that real vLLM serves (4 layers, hidden 128, 4 heads of 32
  with 2 KV heads, float32, ~2.7 MiB), one tensor per shard, so its 39 tensors are exactly the repo's 39 shards
  `model-000NN-of-00039.safetensors`; its index, config, generation config, and a byte-level BPE tokenizer
  written out directly (256 byte tokens, no merges: nothing is trained) with the chat template in
  `tokenizer_config.json`. Random weights answer nonsense; their logprobs are real and finite.
- the base repo: all 48 shards `model-000NN-of-00048.safetensors` (one U8 tensor each, a few KiB), an index
  naming all 48, config.json and a README (which staging must not fetch). As in the real repo, shards 47 and 48
  also hold the Engram embed tables (`model.layers.{1,14}.engram.embed.weight` / `.scale`), which the index maps
  there beside the shards' other tensors: staging's slim Engram directory lists only those. Only the recipe's
  Engram path reads them; real vLLM serving the tiny model does not.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
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
    return safetensors_tensors({tensor: data}, metadata)


def _st_header(tensors: dict[str, bytes], metadata: dict[str, str]) -> bytes:
    entries: dict[str, object] = {"__metadata__": metadata}
    offset = 0
    for name, data in tensors.items():
        entries[name] = {"dtype": "U8", "shape": [len(data)], "data_offsets": [offset, offset + len(data)]}
        offset += len(data)
    return json.dumps(entries, separators=(",", ":")).encode()


def safetensors_tensors(tensors: dict[str, bytes], metadata: dict[str, str], size: int | None = None) -> bytes:
    """U8 tensors in the safetensors layout, in order; `size`: the last tensor's data is cut so the file is exactly
    that long (the header keeps the room its longest form needs, padded with spaces as the format allows)."""
    if size is not None:
        *first, (last, data) = tensors.items()
        room = len(_st_header({**dict(first), last: bytes(size)}, metadata))
        room += -room % 8
        if size < 8 + room + sum(len(d) for _, d in first):
            raise ValueError(f"size={size} cannot hold the header and the other tensors")
        tensors = {**dict(first), last: data[: size - 8 - room - sum(len(d) for _, d in first)]}
        header = _st_header(tensors, metadata).ljust(room)
    else:
        header = _st_header(tensors, metadata)
        header += b" " * (-len(header) % 8)
    return struct.pack("<Q", len(header)) + header + b"".join(tensors.values())


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


# The tiny Llama's shape. vLLM's CPU attention needs a head size of at least 32; 2 KV heads split over TP=2.
TINY = {
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
}
SPECIAL_TOKENS = ("<s>", "</s>", "<｜User｜>", "<｜Assistant｜>", "<｜end▁of▁sentence｜>")
VOCAB_SIZE = 256 + len(SPECIAL_TOKENS)
BOS_ID, EOS_ID = 256, 257
# The sim chat template (the recipe image's path holds its twin, sim/image/chat_template.jinja).
CHAT_TEMPLATE = (
    "{{- bos_token -}}{%- for message in messages -%}"
    "{%- if message['role'] == 'system' -%}{{ message['content'] }}"
    "{%- elif message['role'] == 'user' -%}<｜User｜>{{ message['content'] }}"
    "{%- elif message['role'] == 'assistant' -%}<｜Assistant｜>{{ message['content'] or '' }}<｜end▁of▁sentence｜>"
    "{%- endif -%}{%- endfor -%}{%- if add_generation_prompt -%}<｜Assistant｜>{%- endif -%}"
)


def tiny_tensors() -> list[tuple[str, list[int]]]:
    """The tiny Llama's 39 parameter names and shapes, in checkpoint order (HF Llama naming)."""
    h, i, v = TINY["hidden_size"], TINY["intermediate_size"], VOCAB_SIZE
    q = TINY["num_attention_heads"] * TINY["head_dim"]
    kv = TINY["num_key_value_heads"] * TINY["head_dim"]
    out: list[tuple[str, list[int]]] = [("model.embed_tokens.weight", [v, h])]
    for layer in range(TINY["num_hidden_layers"]):
        p = f"model.layers.{layer}"
        out += [
            (f"{p}.input_layernorm.weight", [h]),
            (f"{p}.self_attn.q_proj.weight", [q, h]),
            (f"{p}.self_attn.k_proj.weight", [kv, h]),
            (f"{p}.self_attn.v_proj.weight", [kv, h]),
            (f"{p}.self_attn.o_proj.weight", [h, q]),
            (f"{p}.post_attention_layernorm.weight", [h]),
            (f"{p}.mlp.gate_proj.weight", [i, h]),
            (f"{p}.mlp.up_proj.weight", [i, h]),
            (f"{p}.mlp.down_proj.weight", [h, i]),
        ]
    return out + [("model.norm.weight", [h]), ("lm_head.weight", [v, h])]


def float_tensor_file(tensor: str, shape: list[int], seed: str, metadata: dict[str, str]) -> bytes:
    """One F32 tensor: norms are ones, every other weight N(0, 0.05) from a seeded generator."""
    count = 1
    for d in shape:
        count *= d
    if tensor.endswith("norm.weight"):
        values = [1.0] * count
    else:
        rng = random.Random(seed)
        values = [rng.gauss(0.0, 0.05) for _ in range(count)]
    data = struct.pack(f"<{count}f", *values)
    header = json.dumps(
        {"__metadata__": metadata, tensor: {"dtype": "F32", "shape": shape, "data_offsets": [0, len(data)]}},
        separators=(",", ":"),
    ).encode()
    header += b" " * (-len(header) % 8)
    return struct.pack("<Q", len(header)) + header + data


def _byte_chars() -> list[str]:
    """GPT-2's byte-to-unicode table: the ByteLevel pre-tokenizer's alphabet, byte b -> the b-th entry."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = [], 0
    for b in range(256):
        if b in keep:
            chars.append(chr(b))
        else:
            chars.append(chr(256 + extra))
            extra += 1
    return chars


def tokenizer_json() -> dict[str, object]:
    """A byte-level BPE tokenizer with no merges: every byte is a token, the specials follow."""
    vocab = {c: b for b, c in enumerate(_byte_chars())}
    added = [
        {
            "id": 256 + n,
            "content": t,
            "single_word": False,
            "lstrip": False,
            "rstrip": False,
            "normalized": False,
            "special": True,
        }
        for n, t in enumerate(SPECIAL_TOKENS)
    ]
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": None,
        "pre_tokenizer": byte_level,
        "post_processor": byte_level,
        "decoder": byte_level,
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": None,
            "continuing_subword_prefix": None,
            "end_of_word_suffix": None,
            "fuse_unk": False,
            "byte_fallback": False,
            "ignore_merges": False,
            "vocab": vocab,
            "merges": [],
        },
    }


def model_repo() -> Repo:
    tensors = tiny_tensors()
    assert len(tensors) == MODEL_SHARDS, "one tensor per shard: the repo has exactly 39 shards"
    files: Repo = {}
    weight_map: dict[str, str] = {}
    for n, (tensor, shape) in enumerate(tensors, start=1):
        name = shard_name(n, MODEL_SHARDS)
        files[name] = float_tensor_file(tensor, shape, f"{MODEL_REPO}/{tensor}", {"format": "pt"})
        weight_map[tensor] = name
    total = sum(len(d) for d in files.values())
    files[INDEX] = _json({"metadata": {"total_size": total}, "weight_map": weight_map})
    files["config.json"] = _json(
        {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            **TINY,
            "vocab_size": VOCAB_SIZE,
            "hidden_act": "silu",
            "rms_norm_eps": 1e-5,
            "rope_theta": 10000.0,
            "tie_word_embeddings": False,
            "max_position_embeddings": 1048576,
            "torch_dtype": "float32",
            "bos_token_id": BOS_ID,
            "eos_token_id": EOS_ID,
        }
    )
    files["generation_config.json"] = _json({"bos_token_id": BOS_ID, "eos_token_id": EOS_ID})
    files["tokenizer_config.json"] = _json(
        {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": "<s>",
            "eos_token": "</s>",
            "model_max_length": 1048576,
            "chat_template": CHAT_TEMPLATE,
            "add_bos_token": False,
        }
    )
    files["tokenizer.json"] = _json(tokenizer_json())
    return files


# Which layer's Engram embed tables each Engram shard holds (upstream's prepare_engram_src.py: layers 1 and 14).
ENGRAM_TABLES = {47: 1, 48: 14}
ENGRAM_EMBED_SUFFIXES = (".engram.embed.weight", ".engram.embed.scale")


def engram_tensors(shard: int) -> list[str]:
    """The Engram embed tables shard 47 or 48 holds (beside its other tensor)."""
    return [f"model.layers.{ENGRAM_TABLES[shard]}{suffix}" for suffix in ENGRAM_EMBED_SUFFIXES]


def base_engram_shard(shard: int, size: int | None = None) -> bytes:
    """Shard 47 or 48 of the base repo: its layer tensor, then the Engram embed tables (the weight last). `size`
    (the staging bench's shards): small other tensors, and the weight cut so the file is exactly `size` bytes."""
    name = shard_name(shard, BASE_SHARDS)
    weight, scale = engram_tensors(shard)
    small = size is not None
    tensors = {
        f"model.layers.{shard - 1}.weight": _payload(f"{BASE_REPO}/{name}", 16 if small else 1024 + 31 * shard),
        scale: _payload(f"{BASE_REPO}/{scale}", 16 if small else 64),
        weight: _payload(f"{BASE_REPO}/{weight}", size or 4096),
    }
    return safetensors_tensors(tensors, {"format": "pt"}, size)


def base_repo() -> Repo:
    files, weight_map = _shards(BASE_REPO, BASE_SHARDS, 1024, 31, "pt")
    for shard in ENGRAM_TABLES:
        files[shard_name(shard, BASE_SHARDS)] = base_engram_shard(shard)
        weight_map.update({t: shard_name(shard, BASE_SHARDS) for t in engram_tensors(shard)})
    total = sum(len(d) for d in files.values())
    files[INDEX] = _json({"metadata": {"total_size": total}, "weight_map": weight_map})
    files["config.json"] = _json(
        {
            "architectures": ["DeepseekV4ForCausalLM"],
            "model_type": "deepseek_v4",
            "num_hidden_layers": BASE_SHARDS,
            "torch_dtype": "bfloat16",
        }
    )
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
    return (
        f"version https://git-lfs.github.com/spec/v1\noid sha256:{hashlib.sha256(data).hexdigest()}\nsize {len(data)}\n"
    ).encode()


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

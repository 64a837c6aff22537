"""Each worker's own copy of the weights (`weights.share: copy`): pure logic, no resources.

- the scripts run on the nodes (source.sh on the head, copy.sh and copy_check.sh on a worker, beside this
  file), rendered with `components.scripts`, and the programs they run: copy_source.py and copy_weights.py, each
  shipped as one zip application of the files its imports name (`shipped.zipapp`);
- each program's config (copy_config.py), the first line of its stdin: whom the source serves, and what the
  copier expects (the head's staging output: size and sha256 per file);
- parsing what the scripts report back.

The token that pairs one worker's copier with the head's source is made per run and travels on stdin only, in
each program's config line.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass

from components import scripts, shipped
from components.weights import manifest as wm
from components.weights.copy_config import CopierConfig, ExpectedFile, SourceConfig
from components.weights.copy_source import LISTENING_MARKER
from components.weights.copy_weights import RECORD_FILE, REPORT_MARKER

NODE_PLACEHOLDER = "{node}"
IDENT_MARKER = "DSV41_COPY_SOURCE_IDENT"
CHECK_MARKER = "COPY_CHECK"
DEFAULT_STREAMS = 4


def copy_root_for(copy_root: str, node: str) -> str:
    """The copy root on `node`: `{node}` in the configured root is the node's name (nodes sharing one
    filesystem, as in the simulated cluster, each need a directory of their own)."""
    return copy_root.replace(NODE_PLACEHOLDER, node)


def source_container(stack_prefix: str, worker: str) -> str:
    return f"{wm.stage_container(stack_prefix).removesuffix('-stage-weights')}-weights-source-{worker}"


def copier_container(stack_prefix: str) -> str:
    return f"{wm.stage_container(stack_prefix).removesuffix('-stage-weights')}-weights-copy"


# The programs run in the throwaway containers: each module and the files its imports name, one zip application.
SOURCE_PROGRAM = "components.weights.copy_source"
COPIER_PROGRAM = "components.weights.copy_weights"
# The source outlives the copy's own bound by this much at most, whatever its stdin says.
SOURCE_LIFETIME_MARGIN_S = 600


def source_program_text() -> str:
    """The head's source as one line of base64 (a zip application, the same bytes for the same files): source.sh
    decodes it to copy_source.pyz."""
    return shipped.zipapp_text(SOURCE_PROGRAM)


def copier_program_text() -> str:
    """The worker's copier as one line of base64 (a zip application), shipped on stdin after its config line;
    copy.sh decodes it to copy_weights.pyz."""
    return shipped.zipapp_text(COPIER_PROGRAM)


def source_config(*, token: str, worker_fabric_ip: str, timeout_s: int) -> SourceConfig:
    """What the head's source serves for one copy: the staged directories a rank reads (never engram-src/), to
    this worker's fabric address only, for the copy's bound and a margin at most."""
    return SourceConfig(
        token=token,
        allow=(worker_fabric_ip,),
        dirs=wm.SERVED_DIRS,
        max_lifetime_s=timeout_s + SOURCE_LIFETIME_MARGIN_S,
    )


def copier_config(*, token: str, files: Mapping[str, int], sha256: Mapping[str, str]) -> CopierConfig:
    """What the copier must end with: every file given (the worker's rank reads `model/` and the slim Engram
    directory: manifest.served_files), its size and the sha256 staging verified."""
    missing = sorted(set(files) - set(sha256))
    if missing:
        raise ValueError(f"staging recorded no sha256 for {missing[:3]}: a copy could not be verified; re-stage")
    expected = tuple(ExpectedFile(path=p, size=int(files[p]), sha256=sha256[p]) for p in sorted(files))
    return CopierConfig(token=token, expected=expected)


def copier_stdin(config: CopierConfig) -> str:
    """What copy.sh reads: the copier's config line (the token among it), then the copier (one line of base64)."""
    return f"{config.to_line()}\n{copier_program_text()}\n"


def render_source_command(*, abs_root: str, bind: str, image: str, container: str) -> str:
    """source.sh, rendered: serve the head's weights root read-only to one copier while stdin stays open."""
    if not abs_root.startswith("/"):
        raise ValueError(f"the head's weights root {abs_root!r} must be absolute (as staging reports it)")
    return scripts.render(
        "weights/source.sh",
        {
            "WEIGHTS_ROOT": abs_root,
            "BIND": wm.validate_ip("head fabric_ip", bind),
            "IMAGE": image,
            "CONTAINER": container,
            "SOURCE_PYZ": source_program_text(),
        },
    )


def render_copy_command(
    *,
    node: str,
    copy_root: str,
    source: str,
    source_ident: str,
    bind: str,
    image: str,
    container: str,
    streams: int,
    timeout_s: int,
) -> str:
    """copy.sh, rendered: run the copier in a throwaway container; its config (the token, the expected files) and
    the program come on stdin (`copier_stdin`)."""
    if streams < 1 or timeout_s <= 0:
        raise ValueError(f"streams={streams} and timeout_s={timeout_s} must be positive")
    return scripts.render(
        "weights/copy.sh",
        {
            "NODE": node,
            "COPY_ROOT": wm.root_value(copy_root),
            "MODEL_DIR": wm.MODEL_DIR,
            "ENGRAM_VLLM_DIR": wm.ENGRAM_VLLM_DIR,
            "SOURCE": source,
            "SOURCE_IDENT": source_ident,
            "BIND": wm.validate_ip(f"{node} fabric_ip", bind),
            "IMAGE": image,
            "CONTAINER": container,
            "STREAMS": streams,
            "TIMEOUT_S": timeout_s,
        },
    )


def render_copy_check(*, copy_root: str, files: Mapping[str, int], sha256: Mapping[str, str]) -> str:
    """copy_check.sh, rendered: which files of the copy are not the verified ones, by record and stat only."""
    listing = "".join(f"{sha256.get(p, '')}\t{size}\t{p}\n" for p, size in sorted(files.items()))
    return scripts.render(
        "weights/copy_check.sh",
        {"COPY_ROOT": wm.root_value(copy_root), "RECORD": RECORD_FILE, "EXPECTED": scripts.text_value(listing)},
    )


@dataclass(frozen=True)
class SourceReady:
    port: int
    ident: str


def parse_source_line(line: str, ready: dict[str, str]) -> SourceReady | None:
    """Feed source.sh's stdout line by line; returns the source once it listens."""
    if line.startswith(IDENT_MARKER + " "):
        ready["ident"] = line[len(IDENT_MARKER) + 1 :].strip()
    elif line.startswith(LISTENING_MARKER + " "):
        return SourceReady(port=int(line.split()[1]), ident=ready.get("ident", ""))
    return None


@dataclass(frozen=True, kw_only=True)
class CopyReport:
    root: str
    copied: tuple[str, ...]
    bytes: int
    seconds: float
    files: int
    page_cache: wm.PageCacheDropped | None = None  # None: an older copier, which dropped nothing


def parse_copy_report(stdout: str) -> CopyReport:
    lines = [ln for ln in stdout.splitlines() if ln.startswith(REPORT_MARKER + " ")]
    if not lines:
        raise ValueError(f"the weights copy printed no '{REPORT_MARKER}' line; see its stderr")
    raw = json.loads(lines[-1][len(REPORT_MARKER) + 1 :])
    return CopyReport(
        root=str(raw["root"]),
        copied=tuple(raw["copied"]),
        bytes=int(raw["bytes"]),
        seconds=float(raw["seconds"]),
        files=int(raw["files"]),
        page_cache=wm.parse_page_cache(raw.get("page_cache")),
    )


_CHECK_LINE = re.compile(r"^(MISSING|UNVERIFIED|CHANGED|MODIFIED) (.+)$")


def parse_copy_check(stdout: str) -> dict[str, str]:
    """{path: why} for every file of the copy that is not the verified one; raises when the check did not finish."""
    if not any(ln.startswith(CHECK_MARKER + " ") for ln in stdout.splitlines()):
        raise ValueError("the copy check printed no summary line")
    return {m.group(2): m.group(1).lower() for ln in stdout.splitlines() if (m := _CHECK_LINE.match(ln))}

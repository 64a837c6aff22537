"""Config validation: the recipe's rules, each refused with the key, the value and the fix."""

from __future__ import annotations

import argparse
import copy
import json
from pathlib import Path
from typing import Any, NoReturn

import pytest
import yaml
from hypothesis import given
from hypothesis import strategies as st

from components import capacity
from components.config import NAMESPACE, VLLM_SHORT_OPTIONS, ConfigError, canonical_flag, parse, read_raw
from tests.support.configs import two_sparks

ROOT = Path(__file__).resolve().parents[2]


def problems_of(raw: dict[str, Any], **kw: Any) -> list[str]:
    with pytest.raises(ConfigError) as err:
        parse(raw, **kw)
    return err.value.problems


def test_recipe_defaults_apply_when_only_nodes_and_ssh_are_given() -> None:
    s = parse(two_sparks()).settings
    assert s.serve.max_model_len == 600_000
    assert s.serve.max_num_seqs == 2
    assert s.serve.max_num_batched_tokens == 1536
    assert s.serve.kv_cache_memory_bytes == 2_684_354_560
    assert s.serve.gpu_memory_utilization == 0.88
    assert s.serve.enforce_eager is False
    assert s.serve.quantization == "exl3"
    assert s.serve.num_speculative_tokens == 3
    assert s.serve.port == 8888
    assert s.serve.served_model_name == "DeepSeek-v4.1-Flash-EXL3"
    assert s.preflight.min_mem_available_gib == 111.5
    assert s.preflight.min_free_disk_gib == 387
    assert s.watchdog.enabled and s.watchdog.mem_available_floor_gib == 1.5
    assert s.head.fabric_interface == "enp1s0f1np1" and s.head.ib_hcas == ["rocep1s0f1"]
    assert s.head.gid_index == "auto" and s.workers[0].gid_index == 3
    assert s.head.rdma_devices == ["/dev/infiniband"] and s.head.gpus == "all"
    assert s.tensor_parallel_size == 2


def test_unfilled_dev_stack_lists_every_missing_key_at_once() -> None:
    stack = yaml.safe_load((ROOT / "Pulumi.dev.yaml").read_text())["config"]
    # The engine hands structured values to the program as JSON text.
    raw = read_raw({k: json.dumps(v) if not isinstance(v, str) else v for k, v in stack.items()})
    problems = problems_of(raw)
    text = "\n".join(problems)
    for i in (0, 1):
        for key in ("host", "user", "fabricIp"):
            assert f"`nodes[{i}].{key}`" in text, f"missing key nodes[{i}].{key} not named:\n{text}"
    assert "`ssh`" in text, "the missing SSH credential must be reported with the others"
    assert "placeholder" in text


def test_read_raw_keeps_only_the_namespace_and_decodes_json() -> None:
    raw = read_raw({f"{NAMESPACE}:serve": '{"port": 9000}', f"{NAMESPACE}:image": "img:1", "other:x": "1"})
    assert raw == {"serve": {"port": 9000}, "image": "img:1"}


def test_misspelt_keys_are_reported_not_ignored() -> None:
    raw = two_sparks(serve={"maxModelLength": 500000}, imgae="x")
    text = "\n".join(problems_of(raw))
    assert "`serve.maxModelLength`" in text and "`imgae`" in text and "not a known key" in text


def test_kv_cache_dtype_in_extra_args_is_refused() -> None:
    raw = two_sparks(serve={"extraArgs": ["--kv-cache-dtype=fp8"]})
    (p,) = problems_of(raw)
    assert "`serve.extraArgs`" in p and "--kv-cache-dtype" in p and "fp8_ds_mla" in p


def test_flags_the_program_owns_are_refused_in_extra_args() -> None:
    raw = two_sparks(serve={"extraArgs": ["--tensor-parallel-size", "4", "--master-port=1"]})
    text = "\n".join(problems_of(raw))
    assert "--tensor-parallel-size" in text and "number of entries in `nodes`" in text
    assert "serve.masterPort" in text


def test_one_million_context_on_two_nodes_is_refused_with_the_recipe_arithmetic() -> None:
    raw = two_sparks(serve={"maxModelLen": 1_000_000})
    text = "\n".join(problems_of(raw))
    assert "`serve.maxModelLen` = 1000000 on 2 nodes" in text
    assert "1M needs TP=4" in text


def test_one_million_context_on_four_nodes_with_a_4_gib_pool_is_accepted() -> None:
    raw = two_sparks(serve={"maxModelLen": 1_000_000, "kvCacheMemoryBytes": 4 * 1024**3})
    raw["nodes"] += [
        {"name": "spark-3", "host": "10.0.0.3", "user": "me", "fabricIp": "192.168.100.3"},
        {"name": "spark-4", "host": "10.0.0.4", "user": "me", "fabricIp": "192.168.100.4"},
    ]
    s = parse(raw).settings
    assert s.tensor_parallel_size == 4


def test_a_3_gib_pool_on_two_nodes_is_refused_for_the_head_margin() -> None:
    raw = two_sparks(serve={"kvCacheMemoryBytes": 3 * 1024**3})
    (p,) = problems_of(raw)
    assert "`serve.kvCacheMemoryBytes` = 3221225472" in p and "prefill margin" in p and "470K" in p


def test_pool_too_small_for_max_model_len_is_refused() -> None:
    raw = two_sparks(serve={"kvCacheMemoryBytes": 1024**3})
    (p,) = problems_of(raw)
    assert "cannot hold one 600000-token request" in p


@pytest.mark.parametrize("count", [1, 3])
def test_node_counts_that_cannot_be_a_tensor_parallel_size_are_refused(count: int) -> None:
    raw = two_sparks()
    raw["nodes"] = [
        {"name": f"n{i}", "host": f"10.0.0.{i}", "user": "me", "fabricIp": f"192.168.100.{i}"}
        for i in range(1, count + 1)
    ]
    (p,) = problems_of(raw)
    assert f"`nodes` has {count} entr" in p


def test_duplicate_hosts_fabric_ips_and_names_are_refused() -> None:
    raw = two_sparks()
    raw["nodes"][1].update(host="10.0.0.1", fabricIp="192.168.100.1", name="spark-head")
    text = "\n".join(problems_of(raw))
    assert "`nodes[1].host`" in text and "`nodes[1].fabricIp`" in text and "`nodes[1].name`" in text


def test_same_host_on_another_port_is_a_different_node() -> None:
    raw = two_sparks()
    raw["nodes"][1].update(host="10.0.0.1", port=2222)
    assert parse(raw).settings.nodes[1].port == 2222


@pytest.mark.parametrize("value", ["", "<head SSH address>", "CHANGE-ME"])
def test_placeholders_are_refused(value: str) -> None:
    raw = two_sparks()
    raw["nodes"][0]["host"] = value
    (p,) = problems_of(raw)
    assert "`nodes[0].host`" in p and "placeholder" in p


def test_bad_values_name_key_value_and_fix() -> None:
    raw = two_sparks(serve={"gpuMemoryUtilization": 1.5, "port": 29521})
    raw["nodes"][0]["fabricIp"] = "not-an-ip"
    raw["nodes"][1]["gidIndex"] = 300
    text = "\n".join(problems_of(raw))
    assert '`nodes[0].fabricIp` = "not-an-ip"' in text and "IPv4" in text
    assert "`nodes[1].gidIndex` = 300" in text and "auto" in text
    assert "`serve.gpuMemoryUtilization` = 1.5" in text


def test_rendezvous_port_must_differ_from_api_port() -> None:
    raw = two_sparks(serve={"port": 29521})
    (p,) = problems_of(raw)
    assert "`serve.masterPort`" in p


def test_enforce_eager_is_allowed_with_a_warning_about_speed() -> None:
    loaded = parse(two_sparks(serve={"enforceEager": True}))
    assert any("11-13 tok/s" in w for w in loaded.warnings)


def test_plaintext_secrets_are_refused_and_never_echoed() -> None:
    raw = two_sparks(serve={"apiKey": "sk-very-secret-0123456789abcdef0"})
    text = "\n".join(problems_of(raw, plaintext_keys=frozenset({"serve", "ssh"})))
    assert "`serve.apiKey` is stored in plain text" in text and "--secret" in text
    assert "`ssh.privateKey` is stored in plain text" in text
    assert "sk-very-secret-0123456789abcdef0" not in text and "OPENSSH" not in text


def test_secret_values_never_appear_in_validation_errors() -> None:
    raw = two_sparks(serve={"apiKey": 12345})
    raw["ssh"]["privateKey"] = ["kp-first-secret-part", "kp-second-secret-part"]
    problems = problems_of(raw)
    text = "\n".join(problems)
    assert any(p.startswith("`ssh.privateKey` = [secret]") for p in problems), text
    assert any(p.startswith("`serve.apiKey` = [secret]") for p in problems), text
    assert "12345" not in text and "kp-first" not in text and "kp-second" not in text


KEY_TEXT = (
    "-----BEGIN OPENSSH PRIVATE KEY-----\nb3BlbnNzaC1rZXktdjEAAAAABG5vbmUAAAAEbm9uZQ\n"
    "QyNTUxOQAAACDk9v2secretline\n-----END OPENSSH PRIVATE KEY-----\n"
)


@pytest.mark.parametrize("secret_keys", [frozenset(), frozenset({"ssh"})])
def test_a_key_given_as_the_whole_ssh_section_is_never_echoed(secret_keys: frozenset[str]) -> None:
    # `pulumi config set --secret ssh < ~/.ssh/id_ed25519`, forgetting `--path ssh.privateKey`.
    raw = two_sparks(ssh=KEY_TEXT)
    text = "\n".join(problems_of(raw, secret_keys=secret_keys))
    assert "`ssh`" in text
    for line in KEY_TEXT.splitlines():
        assert line not in text
    assert json.dumps(KEY_TEXT)[1:-1] not in text and "secretline" not in text


def test_a_token_given_as_a_whole_section_is_never_echoed() -> None:
    raw = two_sparks(weights="hf_wholeSectionToken123", serve="sk-whole-section-key-0123456789a")
    text = "\n".join(problems_of(raw, secret_keys=frozenset({"weights", "serve"})))
    assert "`weights`" in text and "`serve`" in text
    assert "hf_wholeSectionToken123" not in text and "sk-whole-section-key-0123456789a" not in text


def test_text_of_a_secret_section_is_masked_wherever_it_is_echoed() -> None:
    # A misspelt leaf under an encrypted section: the value is shown nowhere.
    raw = two_sparks()
    raw["ssh"]["private_key"] = "tok-misspelt-leaf-value"
    text = "\n".join(problems_of(raw, secret_keys=frozenset({"ssh"})))
    assert "private_key" in text and "tok-misspelt-leaf-value" not in text


def test_settings_repr_hides_secrets() -> None:
    s = parse(two_sparks(serve={"apiKey": "sk-abc-0123456789abcdef012345678"})).settings
    assert "sk-abc-0123456789abcdef012345678" not in repr(s) and "OPENSSH" not in repr(s)


def test_ssh_needs_a_key_or_an_agent() -> None:
    raw = two_sparks(ssh={})
    (p,) = problems_of(raw)
    assert "privateKey" in p and "agentSocket" in p
    raw = two_sparks(ssh={"agentSocket": "/run/user/1000/ssh-agent.sock"})
    assert parse(raw).settings.ssh.agent_socket


@given(
    st.integers(min_value=1024, max_value=2_000_000),
    st.integers(min_value=2**28, max_value=8 * 2**30),
    st.sampled_from([2, 4, 8]),
)
def test_capacity_rules_are_monotonic(max_len: int, pool: int, tp: int) -> None:
    """If a config passes, a shorter context or more nodes with the same pool also passes."""
    ok = not capacity.problems(tensor_parallel_size=tp, max_model_len=max_len, kv_cache_memory_bytes=pool)
    if ok:
        assert not capacity.problems(tensor_parallel_size=tp, max_model_len=max_len // 2, kv_cache_memory_bytes=pool)
        if tp < 8:
            assert not capacity.problems(tensor_parallel_size=tp * 2, max_model_len=max_len, kv_cache_memory_bytes=pool)


def test_recipe_working_point_passes_and_its_failing_point_does_not() -> None:
    assert capacity.head_margin_gib(2.5, 2) == pytest.approx(2.1)
    assert capacity.head_margin_gib(3.0, 2) == pytest.approx(1.1)
    assert not capacity.problems(tensor_parallel_size=2, max_model_len=600_000, kv_cache_memory_bytes=2_684_354_560)
    assert capacity.problems(tensor_parallel_size=2, max_model_len=600_000, kv_cache_memory_bytes=3 * 1024**3)


def test_parse_does_not_mutate_its_input() -> None:
    raw = two_sparks()
    before = copy.deepcopy(raw)
    parse(raw)
    assert raw == before


def test_sim_stack_config_is_valid_with_the_key_make_demo_sets() -> None:
    from sim import stack as sim_stack

    sim = {
        "nodes": [{"index": 1, "ip": "127.0.0.2"}, {"index": 2, "ip": "127.0.0.3"}],
        "ssh": {"port": 2222, "user": "root", "known_hosts": "/x/known_hosts"},
        "hub": "http://127.0.0.1:5080",
        "image": "127.0.0.1:5000/dsv41-exl3/standin:2.9bpw",
    }
    raw = json.loads(json.dumps(sim_stack.sim_config(sim, weights_root="/var/tmp/w")))
    raw["ssh"]["privateKey"] = KEY_TEXT  # make demo sets a real key
    s = parse(raw).settings
    assert [n.host for n in s.nodes] == ["127.0.0.2", "127.0.0.3"] and s.weights.share == "bind"
    assert all(not n.rdma_devices and not n.gpus for n in s.nodes)


def test_extra_env_numbers_from_yaml_are_taken_as_text() -> None:
    # `pulumi config set --path serve.extraEnv.X 5` and YAML `X: 5` both give a number.
    env = parse(two_sparks(serve={"extraEnv": {"SIM_LOAD_SECONDS": 5, "FLAG": True, "NAME": "x"}})).settings.serve
    assert env.extra_env == {"SIM_LOAD_SECONDS": "5", "FLAG": "true", "NAME": "x"}


# --- issue 10: the launcher's rules -----------------------------------------------------------------


def test_long_prefill_threshold_that_breaks_the_launchers_rule_is_refused_with_the_fix() -> None:
    problems = problems_of(two_sparks(serve={"longPrefillTokenThreshold": 1792, "extraEnv": {"NNODES": "3"}}))
    threshold = next(p for p in problems if "longPrefillTokenThreshold" in p)
    assert "`serve.longPrefillTokenThreshold` = 1792" in threshold and "`serve.maxNumBatchedTokens` = 1536" in threshold
    assert ">= 256" in threshold and "at most 1280" in threshold
    assert any("`serve.extraEnv` sets NNODES" in p for p in problems), "every problem is reported together"
    assert parse(two_sparks(serve={"longPrefillTokenThreshold": 1280})).settings.serve.long_prefill_token_threshold


def test_a_batch_too_small_to_derive_a_threshold_is_refused() -> None:
    (problem,) = problems_of(two_sparks(serve={"maxNumBatchedTokens": 256}))
    assert "`serve.maxNumBatchedTokens` = 256" in problem and "raise it" in problem


@pytest.mark.parametrize("var", ["NNODES", "VLLM_ENGINE_READY_TIMEOUT_S", "DSV41_CACHE_GIB", "NCCL_IB_GID_INDEX"])
def test_env_the_program_renders_is_refused_in_extra_env(var: str) -> None:
    (problem,) = problems_of(two_sparks(serve={"extraEnv": {var: "1"}}))
    assert f"`serve.extraEnv` sets {var}: the program renders it" in problem


def test_relative_chat_template_is_refused() -> None:
    (problem,) = problems_of(two_sparks(serve={"chatTemplate": "chat_template.jinja"}))
    assert '`serve.chatTemplate` = "chat_template.jinja"' in problem and "absolute path" in problem


def test_engram_memory_and_small_fused_rows_warn() -> None:
    loaded = parse(two_sparks(serve={"engramCacheGiB": 8, "exl3TempRowsFused": 4}))
    assert any("engramCacheGiB" in w and "~4 GiB MemAvailable" in w for w in loaded.warnings)
    assert any("`serve.exl3TempRowsFused` = 4" in w and "= 8" in w for w in loaded.warnings)
    assert not parse(two_sparks()).warnings


@pytest.mark.parametrize(
    "flag, owner",
    [
        ("--max_model_len=1048576", "serve.maxModelLen"),
        ("--max-model-len", "serve.maxModelLen"),
        ("--max-model", "serve.maxModelLen"),  # argparse's prefix matching
        ("--kv_cache_memory_bytes=9", "serve.kvCacheMemoryBytes"),
        ("-tp", "nodes"),
        ("-tp=4", "nodes"),
        ("-q", "serve.quantization"),
        ("-qfp8", "serve.quantization"),
        ("-pp", "one rank per node"),
        ("-dpl", "one rank per node"),
        ("--data-parallel-size-local=1", "one rank per node"),
        # vLLM 0.32's other aliases of owned flags, and argparse's abbreviations of them
        ("-n", "number of entries in `nodes`"),
        ("-n2", "number of entries in `nodes`"),
        ("-n=2", "number of entries in `nodes`"),
        ("-r", "position in `nodes`"),
        ("-r1", "position in `nodes`"),
        ("-t", "nodes"),
        ("-sc", "serve.numSpeculativeTokens"),
        ("-s", "serve.numSpeculativeTokens"),
        ("-tp4", "nodes"),
        ("--no-enforce-eager", "serve.enforceEager"),
        ("--speculative-config.num_speculative_tokens=5", "serve.numSpeculativeTokens"),
        ("--hf-token=hf_x", "weights.hfToken"),
        ("--served_model_name", "serve.servedModelName"),
    ],
)
def test_owned_flags_are_refused_in_every_spelling_vllm_accepts(flag: str, owner: str) -> None:
    text = "\n".join(problems_of(two_sparks(serve={"extraArgs": [flag, "1"]})))
    assert f"`serve.extraArgs` contains {flag!r}" in text and owner in text


class _Refusing(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise ValueError(message)


def test_one_dash_arguments_are_read_as_argparse_reads_them_with_vllms_options() -> None:
    # vLLM 0.32's one-dash options on an argparse parser: what argparse binds an argument to is what the rule
    # must call it (the exact alias, a value attached or after `=`, an abbreviation of a one-dash option).
    parser = _Refusing(add_help=False)
    for short, long in VLLM_SHORT_OPTIONS.items():
        parser.add_argument(short, long, dest=long)
    tried = [
        *VLLM_SHORT_OPTIONS,
        "-n2",
        "-nn",
        "-nfoo",
        "-n=2",
        "-r0",
        "-rx",
        "-r=1",
        "-qexl3",
        "-tp=4",
        "-t",
        "-s",
        "-as",
        "-e",
        "-c",
        "-dpn=1",
        "-sc={}",
        "-ngl",
        "-d",
        "-p",
        "-x",
    ]
    checked = []
    for arg in tried:
        try:
            namespace, rest = parser.parse_known_args([arg, "1"])
        except ValueError:
            continue  # ambiguous (-d, -p): vLLM refuses it at start
        if arg in rest:
            continue  # not an option argparse knows (-x): vLLM refuses it at start
        (bound,) = [dest for dest, value in vars(namespace).items() if value is not None]
        assert canonical_flag(arg) == bound, arg
        checked.append(arg)
    assert len(checked) == len(tried) - 3
    assert canonical_flag("-O3") == "--optimization-level" and canonical_flag("-1") is None
    assert not [s for s in VLLM_SHORT_OPTIONS if s[1] in "nr" and s not in ("-n", "-r")], (
        "only -n and -r start with n or r: another such option would be misread by their prefix rule"
    )


def test_other_one_dash_options_of_vllm_pass() -> None:
    args = ["-cc", '{"level": 3}', "-ep", "-asc", "2", "-dcp", "1", "-O3", "-ac", "{}"]
    assert parse(two_sparks(serve={"extraArgs": args})).settings.serve.extra_args == args


def test_kv_cache_dtype_is_refused_with_underscores_too() -> None:
    text = "\n".join(problems_of(two_sparks(serve={"extraArgs": ["--kv_cache_dtype=fp8"]})))
    assert "fp8_ds_mla" in text


def test_flags_the_program_does_not_own_pass() -> None:
    args = ["--host", "127.0.0.1", "-O3", "--enable-prefix-caching", "--max-logprobs", "20", "-1"]
    assert parse(two_sparks(serve={"extraArgs": args})).settings.serve.extra_args == args


@pytest.mark.parametrize(
    "var, why",
    [
        ("NCCL_IB_GID_INDEX", "nodes[].gidIndex"),
        ("VLLM_HOST_IP", "fabricIp"),
        ("VLLM_API_KEY", "serve.apiKey"),
        ("HF_TOKEN", "names a credential"),
        ("HUGGING_FACE_HUB_TOKEN", "names a credential"),
        ("MY_SERVICE_API_KEY", "names a credential"),
        ("BAD-NAME", "not an environment variable name"),
    ],
)
def test_extra_env_cannot_override_per_node_values_or_carry_credentials(var: str, why: str) -> None:
    text = "\n".join(problems_of(two_sparks(serve={"extraEnv": {var: "v"}})))
    assert var in text and why in text


def test_extra_env_names_that_only_resemble_credentials_pass() -> None:
    env = {"SIM_DECODE_TOKENS_PER_SECOND": "20", "NCCL_DEBUG": "INFO", "KEYBOARD": "us"}
    assert parse(two_sparks(serve={"extraEnv": env})).settings.serve.extra_env == env


def test_extra_env_values_are_one_line() -> None:
    text = "\n".join(problems_of(two_sparks(serve={"extraEnv": {"NCCL_DEBUG": "INFO\nX=1"}})))
    assert "`serve.extraEnv.NCCL_DEBUG` holds a newline" in text


def _set(raw: dict[str, Any], path: str, value: Any) -> dict[str, Any]:
    cur: Any = raw
    parts = [int(p) if p.isdigit() else p for p in path.replace("[", ".").replace("]", "").split(".")]
    for part in parts[:-1]:
        cur = cur.setdefault(part, {}) if isinstance(part, str) else cur[part]
    cur[parts[-1]] = value
    return raw


@pytest.mark.parametrize(
    "key, value, fix",
    [
        ("ssh.privateKey", "~/.ssh/id_ed25519", "give the key itself"),
        ("ssh.agentSocket", "$SSH_AUTH_SOCK", "unexpanded variable"),
        ("ssh.agentSocket", "agent.sock", "absolute path"),
        ("weights.root", "dsv41-exl3", "relative path"),
        ("weights.root", "~", "directory of its own"),
        ("weights.root", "/", "directory of its own"),
        ("weights.root", "/home/me", "directory of its own"),
        ("weights.root", "~/../etc", "plain path"),
        ("weights.root", "~other/w", "`~user` is not expanded"),
        ("weights.root", "/srv/dsv41:ro", "must not contain `:` or `,`"),
        ("weights.root", "~/models,v2", "docker's volume syntax splits"),
        ("weights.copyRoot", "/nvme/{node}:x/dsv41", "must not contain `:` or `,`"),
        ("weights.copyRoot", "/nvme/a,b/{node}", "e.g. `/srv/dsv41-exl3`"),
        ("watchdog.memAvailableFloorGiB", 0, "greater than 0"),
        ("watchdog.memAvailableFloorGiB", 2000, "stop every rank at once"),
        ("watchdog.sampleSeconds", 0, "greater than or equal to 1"),
        ("watchdog.consecutiveSamples", 0, "greater than or equal to 1"),
        ("preflight.minMemAvailableGiB", -1, "greater than or equal to 0"),
        ("preflight.minMemAvailableGiB", float("inf"), "finite number"),
        ("preflight.minFreeDiskGiB", float("nan"), "finite number"),
        ("serve.servedModelName", "", "non-empty name"),
        ("serve.servedModelName", "my model", "without spaces"),
        ("nodes[0].host", "me@10.0.0.1", "put the login name in `user`"),
        ("nodes[0].host", "10.0.0.1:22", "put the SSH port in `port`"),
        ("nodes[0].host", "spark head", "hostname or an IP address"),
        ("weights.revision", "main\n", "branch, tag or commit"),
        ("weights.modelRepo", "https://huggingface.co/Mia-AiLab/x", "(not a URL)"),
        ("nodes[0].ibHcas", ["rocep1s0f1"], "rdmaDevices"),
        ("image", "<image>", "placeholder"),
        ("image", "registry:5000/dsv41:2.9bpw ", "whitespace"),
        ("image", "Registry/UPPER:tag", "docker image reference"),
        ("weights.hfEndpoint", "huggingface.co", "with its scheme"),
        ("nodes[0].user", "-oProxyCommand=x", "not starting with '-'"),
    ],
)
def test_late_failing_mistakes_are_refused_with_key_value_and_fix(key: str, value: Any, fix: str) -> None:
    raw = two_sparks()
    if key == "nodes[0].ibHcas":
        raw["nodes"][0]["rdmaDevices"] = []
    problems = problems_of(_set(raw, key, value))
    mine = [p for p in problems if p.startswith(f"`{key}`")]
    assert mine, f"no problem names `{key}`: {problems}"
    assert fix in mine[0], mine[0]
    shown = "[secret]" if key == "ssh.privateKey" else json.dumps(value)
    assert key == "nodes[0].ibHcas" or f"= {shown}" in mine[0], mine[0]


def test_a_token_with_a_line_break_is_refused_without_echoing_it() -> None:
    token = "hf_abcdefghijklmnop"
    problems = problems_of(two_sparks(weights={"hfToken": token + "\n"}), secret_keys=frozenset({"weights"}))
    (mine,) = [p for p in problems if p.startswith("`weights.hfToken`")]
    assert "contains a line break" in mine and "[secret]" in mine
    assert all(token not in p for p in problems)


@pytest.mark.parametrize(
    ("key", "says"),
    [
        ("sk-0123456789abcdef0123456789abcdef\n", "contains whitespace"),
        ("sk-0123456789abcdef 0123456789abcdef", "contains whitespace"),
        ("sk-short-0123456789", "is 19 characters, under 32"),
    ],
)
def test_a_weak_or_mangled_api_key_is_refused_without_echoing_it(key: str, says: str) -> None:
    problems = problems_of(two_sparks(serve={"apiKey": key}), secret_keys=frozenset({"serve"}))
    (mine,) = [p for p in problems if p.startswith("`serve.apiKey`")]
    assert says in mine and "[secret]" in mine and "pulumi config set --secret --path serve.apiKey" in mine, mine
    assert all(key.strip() not in p for p in problems)
    for fine in ("none", "sk-" + "a" * 29, "x" * 64):
        parse(two_sparks(serve={"apiKey": fine}), secret_keys=frozenset({"serve"}))  # no ConfigError


def test_an_ib_hca_that_is_no_device_name_is_refused_with_the_fix() -> None:
    raw = two_sparks()
    raw["nodes"][1]["ibHcas"] = ["rocep1s0f0", "bad name"]
    (problem,) = problems_of(raw)
    assert problem.startswith('`nodes[1].ibHcas` = ["rocep1s0f0", "bad name"]: ["bad name"] is not an RDMA device')
    assert "ls /sys/class/infiniband" in problem


@pytest.mark.parametrize(
    "root",
    [
        "~/dsv41-exl3",
        "/var/tmp/dsv41-exl3-sim-weights",
        "/data/models/dsv41",
        "/home/me/dsv41-exl3",
        "/mnt/nvme/dsv41/",
    ],
)
def test_dedicated_weight_roots_are_accepted(root: str) -> None:
    assert parse(two_sparks(weights={"root": root})).settings.weights.root == root


def test_a_watchdog_floor_above_the_preflight_minimum_is_a_warning() -> None:
    loaded = parse(two_sparks(watchdog={"memAvailableFloorGiB": 100}, preflight={"minMemAvailableGiB": 50}))
    assert any("may stop ranks the preflight admitted" in w for w in loaded.warnings)


def test_copy_mode_takes_a_copy_root_per_worker_with_the_node_placeholder() -> None:
    s = parse(two_sparks(weights={"share": "copy", "copyRoot": "/var/lib/dsv41/{node}", "copyStreams": 8})).settings
    assert s.weights.share == "copy" and s.weights.copy_streams == 8
    assert s.copy_root_of(s.workers[0]) == f"/var/lib/dsv41/{s.workers[0].name}"
    # Unset: the same path as the head's root, on each worker's own disk.
    plain = parse(two_sparks(weights={"share": "copy", "root": "/data/dsv41"})).settings
    assert plain.copy_root_of(plain.workers[0]) == "/data/dsv41"


def test_copy_roots_that_collide_or_are_not_dedicated_are_refused_with_the_fix() -> None:
    raw = two_sparks(weights={"share": "copy", "copyRoot": "/var/lib/dsv41"})
    raw["nodes"].append({**raw["nodes"][1], "name": "spark-2", "host": "10.0.0.3", "fabricIp": "192.168.100.3"})
    problems = problems_of(raw)
    assert any(
        p.startswith('`weights.copyRoot` = "/var/lib/dsv41" gives two workers the same directory') and "{node}" in p
        for p in problems
    ), problems
    problems = problems_of(two_sparks(weights={"share": "copy", "copyRoot": "/home/{node}"}))
    assert any(
        p.startswith('`weights.copyRoot` = "/home/{node}"') and "a directory of its own" in p for p in problems
    ), problems
    problems = problems_of(two_sparks(weights={"share": "copy", "copyStreams": 0}))
    assert any(p.startswith("`weights.copyStreams` = 0") for p in problems), problems
    problems = problems_of(two_sparks(weights={"share": "rsync"}))
    assert any(p.startswith('`weights.share` = "rsync"') and "'copy'" in p for p in problems), problems


def test_staging_downloads_8_files_at_once_unless_told_and_refuses_0_or_more_than_64() -> None:
    assert parse(two_sparks()).settings.weights.download_streams == 8, "the upstream launcher's downloader's 8"
    assert parse(two_sparks(weights={"downloadStreams": 1})).settings.weights.download_streams == 1
    for bad in (0, 65):
        problems = problems_of(two_sparks(weights={"downloadStreams": bad}))
        assert any(p.startswith(f"`weights.downloadStreams` = {bad}") for p in problems), problems


def test_a_copy_root_without_copy_mode_is_a_warning() -> None:
    loaded = parse(two_sparks(weights={"share": "nfs", "copyRoot": "/var/lib/dsv41"}))
    assert any("used only with `share: copy`" in w for w in loaded.warnings)


def test_auto_tool_choice_without_a_parser_is_refused() -> None:
    found = problems_of(two_sparks(serve={"toolCallParser": ""}))
    assert any("`serve.enableAutoToolChoice` = true with `serve.toolCallParser`" in p for p in found), found
    parse(two_sparks(serve={"toolCallParser": "", "enableAutoToolChoice": False}))


@pytest.mark.parametrize("value", [" Paris", "Paris\n", "a\rb"])
def test_expected_answer_is_one_line(value: str) -> None:
    found = problems_of(two_sparks(gates={"expectedAnswer": value}))
    assert any(p.startswith("`gates.expectedAnswer`") and "one line" in p for p in found), found


def test_expected_answer_defaults_to_the_recipes_and_may_be_empty() -> None:
    assert parse(two_sparks()).settings.gates.expected_answer == "Paris"
    assert parse(two_sparks(gates={"expectedAnswer": ""})).settings.gates.expected_answer == ""


def test_the_observability_layer_is_paid_from_the_heads_prefill_margin() -> None:
    recipe = {"tensor_parallel_size": 2, "max_model_len": 600_000, "kv_cache_memory_bytes": 2_684_354_560}
    # The defaults (Prometheus 60 MiB, exporter, node exporter) fit the ~0.1 GiB the recipe's pool leaves.
    assert not capacity.problems(**recipe, prometheus_mib=60, node_exporter=True)
    assert capacity.observability_head_mib(60, True) == 100
    (problem,) = capacity.problems(**recipe, prometheus_mib=512, node_exporter=True)
    assert "`observability.memoryMiB` = 512" in problem and "= 552 MiB" in problem
    assert "at most 62" in problem and "`observability.enabled: false`" in problem
    assert not capacity.problems(**recipe, prometheus_mib=62, node_exporter=True), "the bound the message names fits"
    assert capacity.problems(**recipe, prometheus_mib=63, node_exporter=True)
    # Without the layer nothing is counted; with 4 nodes the freed weights pay for a bigger Prometheus.
    assert not capacity.problems(**recipe, prometheus_mib=None)
    assert not capacity.problems(**{**recipe, "tensor_parallel_size": 4}, prometheus_mib=512, node_exporter=True)


def test_a_prometheus_bound_the_head_cannot_pay_is_refused_only_while_the_layer_is_on() -> None:
    raw = two_sparks(observability={"memoryMiB": 1024})
    (problem,) = problems_of(raw)
    assert "`observability.memoryMiB` = 1024" in problem and "lower `observability.memoryMiB`" in problem
    assert not parse(two_sparks(observability={"memoryMiB": 1024, "enabled": False})).settings.observing
    assert not parse(two_sparks(observability={"memoryMiB": 1024}, supervisor={"enabled": False})).settings.observing


def test_every_listener_port_clash_is_refused_naming_both_keys() -> None:
    raw = two_sparks(
        supervisor={"port": 18390},
        observability={"enabled": True, "port": 8888, "exporterPort": 18392, "nodeExporterPort": 18392},
    )
    text = "\n".join(problems_of(raw))
    assert "`observability.port` = 8888 is also `serve.port`" in text, text
    assert "`observability.nodeExporterPort` = 18392 is also `observability.exporterPort`" in text, text
    raw = two_sparks(supervisor={"port": 18390}, observability={"enabled": True})  # 18390 is Prometheus' default
    assert "`observability.port` = 18390 is also `supervisor.port`" in "\n".join(problems_of(raw))
    parse(two_sparks(observability={"enabled": True}))  # the defaults never clash


# Every timeout and wait the config takes, with the most it allows: a day (in its own unit).
TIMEOUTS_AT_MOST_A_DAY = [
    ("gates.rendezvousTimeoutSeconds", 86400),
    ("gates.readyTimeoutSeconds", 86400),
    ("gates.stallSeconds", 86400),
    ("gates.verifyTimeoutSeconds", 86400),
    ("weights.stageTimeoutMinutes", 1440),
    ("imagePullTimeoutMinutes", 1440),
]


@pytest.mark.parametrize(("key", "day"), TIMEOUTS_AT_MOST_A_DAY)
def test_a_timeout_beyond_a_day_is_refused_with_key_value_and_fix(key: str, day: int) -> None:
    # Minutes typed where seconds go, or one zero too many: a hung step would hold the update for days.
    parse(_set(two_sparks(), key, day))  # a day is allowed
    problems = problems_of(_set(two_sparks(), key, day + 1))
    mine = [p for p in problems if p.startswith(f"`{key}` = {day + 1}:")]
    assert mine and f"set it to {day} or less" in mine[0], problems


def test_a_declared_timeout_is_in_the_list_above() -> None:
    from components.config import Settings
    from components.config import declarations as declared_in

    timeouts = {d.key for d in declared_in(Settings) if "timeout" in d.key.lower()}
    assert timeouts <= {k for k, _ in TIMEOUTS_AT_MOST_A_DAY}, timeouts


def test_a_bound_below_names_the_fix_too() -> None:
    (mine,) = [p for p in problems_of(_set(two_sparks(), "watchdog.sampleSeconds", 0)) if "sampleSeconds" in p]
    assert "set it to 1 or more" in mine, mine

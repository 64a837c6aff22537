"""Node scripts as files: the one-line header, values quoted, errors naming the file and line."""

from __future__ import annotations

import pytest

from components import scripts
from tests.support.scripts import header_value, run_sh

BODY = '#!/bin/sh\nset -eu\n[ "$WHO" = "it\'s me" ] || exit 9\nfail "${LINENO:-}" "boom for $WHO" 7\n'


def test_fail_names_the_file_and_its_own_line_number_in_a_nodes_login_shell() -> None:
    # A remote command runs as `bash -c` on the node (its login shell).
    done = run_sh(scripts.header("layer/thing.sh", {"WHO": "it's me"}) + BODY, shell="bash")
    assert done.returncode == 7
    assert done.stderr.strip() == "components/layer/thing.sh:4: boom for it's me", done.stderr


def test_fail_names_the_file_where_the_shell_keeps_no_line_numbers() -> None:
    done = run_sh(scripts.header("layer/thing.sh", {"WHO": "it's me"}) + BODY, shell="dash")
    assert done.returncode == 7 and done.stderr.strip() == "components/layer/thing.sh: boom for it's me"


def test_an_unexplained_exit_still_names_the_file() -> None:
    done = run_sh(scripts.header("layer/thing.sh", {}) + "set -eu\nfalse\necho unreachable\n")
    assert done.returncode == 1 and "components/layer/thing.sh: exited 1" in done.stderr
    assert "unreachable" not in done.stdout


def test_values_are_quoted_so_nothing_in_them_runs() -> None:
    done = run_sh(scripts.header("layer/thing.sh", {"X": "$(echo pwned); `id`"}) + 'printf %s "$X"\n')
    assert done.stdout == "$(echo pwned); `id`"


def test_the_header_is_one_line_and_refuses_values_that_are_not() -> None:
    assert scripts.header("a/b.sh", {"A": "1 2", "B": 3}).count("\n") == 1
    with pytest.raises(ValueError, match="one line"):
        scripts.header("a/b.sh", {"A": "1\n2"})


@pytest.mark.parametrize("name", ["lower", "DSV41_SCRIPT", "1X", "A-B"])
def test_header_names_are_upper_case_and_not_ours(name: str) -> None:
    with pytest.raises(ValueError, match="upper case"):
        scripts.header("a/b.sh", {name: "v"})


def test_a_text_value_comes_back_byte_for_byte() -> None:
    text = "line 1 'q' \"d\" $HOME `id`\n\\n \\c \\0101 %s\n\nlast"
    assert header_value(scripts.header("a/b.sh", {"T": scripts.text_value(text)}), "T", as_text=True) == text
    assert (
        run_sh(scripts.header("a/b.sh", {"T": scripts.text_value(text)}) + 'printf %b "$T"\n', shell="bash").stdout
        == text
    )

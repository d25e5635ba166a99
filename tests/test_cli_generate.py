"""`prefixserve generate`'s arguments: a bad value is a usage error (exit 2) before anything loads."""

from __future__ import annotations

import pytest

from prefixserve import cli


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--max-tokens", "0"], "--max-tokens: must be >= 1, not 0"),
        (["--max-tokens", "-3"], "--max-tokens: must be >= 1, not -3"),
        (["--max-tokens", "many"], "--max-tokens: not an integer"),
        (["--temperature", "-1"], "--temperature: must be in [0, 100], not -1"),
        (["--temperature", "nan"], "--temperature: must be in [0, 100], not nan"),
        (["--temperature", "101"], "--temperature: must be in [0, 100]"),
        (["--threads", "0"], "--threads: must be >= 1, not 0"),
    ],
)
def test_bad_arguments_exit_2_before_the_model_loads(monkeypatch: pytest.MonkeyPatch,
                                                     capsys: pytest.CaptureFixture[str], argv: list[str],
                                                     message: str) -> None:
    import prefixserve.engine

    def no_load(*args: object) -> None:
        raise AssertionError("the model must not load for bad arguments")

    monkeypatch.setattr(prefixserve.engine, "build_engine", no_load)
    with pytest.raises(SystemExit) as e:
        cli.main(["generate", "hi", *argv])
    assert e.value.code == 2
    assert message in capsys.readouterr().err

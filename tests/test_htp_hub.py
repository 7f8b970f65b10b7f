"""`npumoe hub` up to the network boundary: without the client or a token it says how to get them, exit 2.

(What compile submits, the built graphs' ONNX files, is checked in test_htp_build.py.)
"""

import sys

import pytest

from npumoe.cli import main


def run(argv, capsys) -> tuple[int, str]:
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    return exit_.value.code, capsys.readouterr().err


def test_missing_client_says_how_to_install(monkeypatch, tmp_path, capsys):
    monkeypatch.setitem(sys.modules, "qai_hub", None)
    code, err = run(["hub", "compile", "--artifacts", str(tmp_path)], capsys)
    assert code == 2 and "pip install qai-hub" in err


def test_without_a_token_one_sentence_and_exit_2(monkeypatch, tmp_path, capsys):
    pytest.importorskip("qai_hub", reason="qai-hub is not installed (pip install qai-hub 'protobuf<=6.31.1')")
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.qai_hub/client.ini here
    for action in ("compile", "profile"):
        code, err = run(["hub", action, "--artifacts", str(tmp_path)], capsys)
        assert code == 2
        assert err.startswith("error: no Qualcomm AI Hub token is configured") and err.count("\n") == 1
        assert "qai-hub configure --api_token" in err

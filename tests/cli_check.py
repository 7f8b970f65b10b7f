"""The CLI's contract for bad input, shared by the error tests of every part."""

import pytest

from npumoe.cli import main


def cli_error(capsys, *argv) -> str:
    """Run ``npumoe *argv``; assert exit 2 with one ``error: …`` line and no traceback; return it."""
    capsys.readouterr()  # drop what came before (e.g. coremltools' conversion progress)
    with pytest.raises(SystemExit) as exit_info:
        main(list(argv))
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "Traceback" not in err and len(err.splitlines()) == 1
    return err

"""A full disk (issue 40): one line saying "No space left on device" and naming the file, not a
logging traceback per record. The full disk is real: ``/dev/full`` fails every write with
ENOSPC (the files are symbolic links to it), so no write is mocked."""

from __future__ import annotations

import os

import pytest

pytestmark = pytest.mark.skipif(
    not os.path.exists("/dev/full"), reason="needs /dev/full (Linux) to fill a write"
)


def test_a_run_log_on_a_full_disk_is_one_warning_line_naming_it(tmp_path, capsys):
    from nrl_core.run_log import log_failure, log_output, open_run_log, run_log_path

    (tmp_path / "nrl.log").symlink_to("/dev/full")
    close = open_run_log(tmp_path)  # its first record already fails
    try:
        for index in range(20):
            log_output("(worker pid=1)", [f"line {index}"])
        # Nothing is written any more: the error lines do not name a log that is not there.
        assert run_log_path() is None and log_failure("x", "y") is None
    finally:
        close()
    err = capsys.readouterr().err
    assert err.splitlines() == [
        f"warning: cannot write the run log {tmp_path / 'nrl.log'} (No space left on device); "
        "it stops here"
    ], err[-3000:]


def test_metrics_on_a_full_disk_are_one_error_line_naming_the_file(tmp_path, capsys):
    """A metrics write that fails names its file; the CLI prints it as one line, exit 1."""
    from nrl_core.config.schema import LoggerConfig
    from nrl_core.metrics import MetricsLogger

    logger = MetricsLogger(tmp_path, LoggerConfig())
    (tmp_path / "metrics.jsonl").unlink()
    (tmp_path / "metrics.jsonl").symlink_to("/dev/full")
    with pytest.raises(OSError) as caught:
        logger.log(1, {"train/loss": 1.0})
    assert caught.value.filename == str(tmp_path / "metrics.jsonl")

    from nrl_core import cli

    def handler(args):
        logger.log(2, {"train/loss": 1.0})

    parser = cli.build_parser
    try:
        cli.build_parser = lambda: _Parser(handler)
        rc = cli.main([])
    finally:
        cli.build_parser = parser
    err = capsys.readouterr().err
    assert rc == 1 and "Traceback" not in err
    assert err.splitlines() == [
        f"error: No space left on device writing {tmp_path / 'metrics.jsonl'}; free space "
        "there, or point logger.log_dir and checkpointing.checkpoint_dir at another disk"
    ]


class _Parser:
    """The CLI's parser reduced to one command whose handler is ``handler``."""

    def __init__(self, handler):
        self.handler = handler

    def parse_known_args(self, argv):
        import argparse

        return argparse.Namespace(handler=self.handler), []

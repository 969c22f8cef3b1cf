"""The entry points' console (pipelines/console.py, pipelines/submit.py): our lines at INFO, the libraries' INFO off the
console unless verbose, warnings always; the submitter passes the job's lines and drops only the job manager's."""

import logging

import pytest

from pipelines import console, submit


@pytest.fixture
def fresh_logging(monkeypatch):
    """Each test sets the console up from scratch and leaves the loggers as it found them."""
    root = logging.getLogger()
    saved = {name: logging.getLogger(name).level for name in ("hllm", *console.LIBRARIES)}
    handlers, level = root.handlers[:], root.level
    root.handlers = []
    monkeypatch.delenv(console.VERBOSE, raising=False)
    yield
    root.handlers, root.level = handlers, level
    for name, lvl in saved.items():
        logging.getLogger(name).setLevel(lvl)


def test_our_lines_show_and_the_libraries_info_does_not(fresh_logging, caplog):
    assert console.setup() is False
    logging.getLogger("hllm.pipelines.data").info("data: 10 slates")
    logging.getLogger("urllib3.connectionpool").info("Starting new HTTP connection (1): 127.0.0.1:8265")
    logging.getLogger("alembic.runtime.migration").info("Running upgrade  -> 451aebb31d03")
    logging.getLogger("urllib3").warning("a real warning")
    assert [r.getMessage() for r in caplog.records] == ["data: 10 slates", "a real warning"]


def test_verbose_brings_the_libraries_back_and_travels_to_child_processes(fresh_logging, caplog, monkeypatch):
    monkeypatch.setenv(console.VERBOSE, "1")
    assert console.setup() is True
    logging.getLogger("urllib3.connectionpool").info("Starting new HTTP connection (1): 127.0.0.1:8265")
    assert [r.getMessage() for r in caplog.records] == ["Starting new HTTP connection (1): 127.0.0.1:8265"]
    monkeypatch.delenv(console.VERBOSE)
    assert console.setup(verbose=True) and console.is_verbose()  # the flag sets the variable for what it starts


def test_the_submitter_drops_only_the_job_managers_two_lines():
    lines = ["Runtime env is setting up.", "Running entrypoint for job raysubmit_x: python pipelines/full.py",
             "00:47:39 config: {...}", "Runtime is a word our own lines may use"]
    assert [line for line in lines if submit._job_line(line)] == lines[2:]


def test_the_submitter_needs_a_command(capsys):
    with pytest.raises(SystemExit) as exit_:
        submit.main(["--address", "http://127.0.0.1:1", "--"])
    assert exit_.value.code == 2 and "no command" in capsys.readouterr().err

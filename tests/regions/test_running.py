"""The run dir (regions.running): a launch holds its port's file while it lives, a second one
on the same port is refused, and a launcher that died leaves nothing listed."""

import subprocess
import sys

import pytest

from regions import running


def test_a_launch_is_listed_while_it_lives_and_a_second_one_is_refused(tmp_path):
    first = running.Registration(8000, "/x/builtin.toml", tmp_path).claim()
    assert [x["state"] for x in running.live(tmp_path)] == ["starting"]
    first.ready({"regions": {"eu": "http://127.0.0.1:8000"}})
    [info] = running.live(tmp_path)
    assert info["state"] == "ready" and info["port"] == 8000 and info["regions"] == {"eu": "http://127.0.0.1:8000"}
    assert info["file"] == str(tmp_path / "8000.json") and info["source"] == "/x/builtin.toml"
    with pytest.raises(running.Held) as e:
        running.Registration(8000, "/x/builtin.toml", tmp_path).claim()
    assert e.value.info["pid"] == info["pid"]
    first.release()
    assert running.live(tmp_path) == []
    running.Registration(8000, "/x/builtin.toml", tmp_path).claim().release()  # free again


def test_a_launcher_that_died_leaves_nothing_listed(tmp_path):
    code = ("import os, sys; from regions import running; "
            f"running.Registration(9000, 'a.toml', running.Path({str(tmp_path)!r})).claim().ready({{}}); os._exit(9)")
    assert subprocess.run([sys.executable, "-c", code], timeout=60).returncode == 9
    assert (tmp_path / "9000.json").exists()  # left behind, but its lock went with the process
    assert running.live(tmp_path) == [] and not (tmp_path / "9000.json").exists()
    running.Registration(9000, "a.toml", tmp_path).claim().release()

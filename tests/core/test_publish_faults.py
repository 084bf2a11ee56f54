"""Issue 9, defect 7: a full disk between a report and its `.sha256` sidecar.

Publication is all-or-nothing from the caller's view: after any OSError nothing of the failed call
is left (no file, no sidecar, no temp), the error names the path and the cause, and the identical
retry completes. Injected with a patched `os.write`/`os.link`, and with a real 64 KiB tmpfs when
this machine lets the test mount one (root).
"""

import errno
import os
import subprocess
import uuid
from pathlib import Path

import pytest

from value_assets.core.errors import InputError
from value_assets.core.hashing import sha256_bytes
from value_assets.core.publish import publish_once, read_sidecar, verify_published

pytestmark = pytest.mark.unit
REPORT = b'{"passed":true,"schema":"value-assets.ev-report.v1"}\n'


def leftovers(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


def enospc():
    return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def assert_clear_enospc(exc: OSError, path: Path):
    assert exc.errno == errno.ENOSPC
    assert str(path) in str(exc) and "No space left on device" in str(exc) and "retry" in str(exc)


def test_enospc_writing_the_sidecar_leaves_nothing_and_the_identical_retry_completes(tmp_path, monkeypatch):
    path = tmp_path / "ev.json"
    real_write = os.write

    def full_disk(fd, data):
        if bytes(data).endswith(b"  ev.json\n"):  # the sidecar line, after the report's bytes
            raise enospc()
        return real_write(fd, data)

    monkeypatch.setattr(os, "write", full_disk)
    with pytest.raises(OSError) as info:
        publish_once(path, REPORT)
    assert_clear_enospc(info.value, path)
    assert leftovers(tmp_path) == []  # no report without its sidecar, no temp file

    monkeypatch.setattr(os, "write", real_write)  # space came back
    sha = publish_once(path, REPORT)
    assert verify_published(path) == sha == sha256_bytes(REPORT)
    assert leftovers(tmp_path) == ["ev.json", "ev.json.sha256"]


def test_failure_linking_the_sidecar_takes_the_report_back(tmp_path, monkeypatch):
    path = tmp_path / "ev.json"
    real_link = os.link

    def link(src, dst, **kw):
        if str(dst).endswith(".sha256"):
            raise enospc()
        return real_link(src, dst, **kw)

    monkeypatch.setattr(os, "link", link)
    with pytest.raises(OSError) as info:
        publish_once(path, REPORT)
    assert_clear_enospc(info.value, path)
    assert leftovers(tmp_path) == []
    monkeypatch.setattr(os, "link", real_link)
    sha = publish_once(path, REPORT)
    assert verify_published(path) == sha


def test_a_report_left_without_its_sidecar_is_completed_by_the_identical_retry_only(tmp_path):
    """The state older code left behind: the identical bytes complete it, other bytes are refused."""
    path = tmp_path / "ev.json"
    path.write_bytes(REPORT)
    with pytest.raises(InputError, match="write-once"):
        publish_once(path, REPORT.replace(b"true", b"false"))
    assert leftovers(tmp_path) == ["ev.json"]
    assert publish_once(path, REPORT) == read_sidecar(tmp_path / "ev.json.sha256") == sha256_bytes(REPORT)


@pytest.fixture
def tiny_tmpfs(tmp_path):
    mount = tmp_path / f"tmpfs-{uuid.uuid4().hex[:8]}"
    mount.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mount)], capture_output=True, text=True
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip() or done.returncode}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", str(mount)], check=True)


def test_real_full_tmpfs_between_report_and_sidecar(tiny_tmpfs):
    """Fill a 64 KiB tmpfs so that the report's page fits and the sidecar's does not."""
    filler = tiny_tmpfs / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT)
    written = 0
    try:
        while True:
            written += os.write(fd, b"\0" * 4096)
    except OSError as exc:
        assert exc.errno == errno.ENOSPC
    finally:
        os.close(fd)
    os.truncate(filler, written - 4096)  # exactly one page free: the report, not its sidecar
    folder = tiny_tmpfs / "reports"
    folder.mkdir()
    path = folder / "ev.json"
    with pytest.raises(OSError) as info:
        publish_once(path, REPORT)
    assert_clear_enospc(info.value, path)
    assert leftovers(folder) == []

    filler.unlink()  # space returns
    sha = publish_once(path, REPORT)
    assert verify_published(path) == sha and leftovers(folder) == ["ev.json", "ev.json.sha256"]


def test_a_reports_plots_are_published_with_it_or_not_at_all(tmp_path, monkeypatch):
    """Issue 33, defect 11: `evaluate` published its plots, then its report; a full disk at the
    report left the plots behind. `publish_all` takes back every name it made when any fails."""
    from value_assets.core.publish import PublishError, publish_all

    plots = [(tmp_path / f"ev-{k}.png", b"png %d" % k) for k in range(3)]
    real_link = os.link

    def link(src, dst, **kw):
        if Path(dst).name == "ev.json":
            raise enospc()
        return real_link(src, dst, **kw)

    monkeypatch.setattr(os, "link", link)
    with pytest.raises(PublishError) as err:
        publish_all(plots + [(tmp_path / "ev.json", REPORT)])
    assert_clear_enospc(err.value, tmp_path / "ev.json")
    assert leftovers(tmp_path) == []
    monkeypatch.setattr(os, "link", real_link)
    shas = publish_all(plots + [(tmp_path / "ev.json", REPORT)])
    assert shas[-1] == sha256_bytes(REPORT) and len(leftovers(tmp_path)) == 8
    (tmp_path / "ev-9.png").write_bytes(b"another")  # a conflict refuses all, and takes nothing existing back
    with pytest.raises(InputError, match="ev-9.png: refusing to replace"):
        publish_all([(tmp_path / "new.png", b"x"), (tmp_path / "ev-9.png", b"y")])
    assert not (tmp_path / "new.png").exists() and (tmp_path / "ev-9.png").read_bytes() == b"another"

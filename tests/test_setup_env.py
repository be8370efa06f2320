"""benchmarks/setup_env.py: a bare copy of the repository made runnable without a registry."""

import base64
import hashlib
import os
import sys
import zipfile

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))

import setup_env as S  # noqa: E402


def _wheel(folder, name="tinypkg_for_setup_test", version="0.1"):
    """A minimal pure-Python wheel, so installing one needs no registry and no network."""
    dist_info = f"{name}-{version}.dist-info"
    files = {
        f"{name}/__init__.py": "VALUE = 42\n",
        f"{dist_info}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n",
        f"{dist_info}/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = []
    for path, text in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b"=").decode()
        record.append(f"{path},sha256={digest},{len(text.encode())}")
    record.append(f"{dist_info}/RECORD,,")
    files[f"{dist_info}/RECORD"] = "\n".join(record) + "\n"
    path = os.path.join(folder, f"{name}-{version}-py3-none-any.whl")
    with zipfile.ZipFile(path, "w") as zf:
        for member, text in files.items():
            zf.writestr(member, text)
    return path


def test_missing_lists_distributions_not_modules():
    present = {"torch"}
    fake = lambda module: object() if module in present else None  # noqa: E731
    assert S.missing({"torch": "torch", "pynvml": "nvidia-ml-py"}, find_spec=fake) == ["nvidia-ml-py"]


def test_missing_package_is_one_line(monkeypatch, capsys):
    monkeypatch.setattr(S, "REQUIRED", dict(S.REQUIRED, surely_absent_module_xyz="absent-dist"))
    assert S.main(["--device", "cpu", "--check-only"]) == 1
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "missing Python packages: absent-dist" in err


def test_wheels_folder_must_hold_wheels(tmp_path):
    with pytest.raises(S.SetupError, match="no such folder"):
        S.wheel_files(str(tmp_path / "nope"))
    with pytest.raises(S.SetupError, match="holds no .whl files"):
        S.wheel_files(str(tmp_path))


def test_wheels_install_offline_into_target(tmp_path):
    wheels, target = tmp_path / "wheels", tmp_path / "site"
    wheels.mkdir()
    _wheel(str(wheels))
    S.install_wheels(str(wheels), str(target))
    assert (target / "tinypkg_for_setup_test" / "__init__.py").read_text() == "VALUE = 42\n"


def test_this_checkout_is_found_installed(capsys):
    assert S.main(["--device", "cpu", "--check-only"]) == 0
    assert "fasttrain: this copy is installed" in capsys.readouterr().err


def test_fasttrain_from_elsewhere_is_reported(tmp_path, monkeypatch):
    monkeypatch.setattr(S, "fasttrain_location", lambda extra_path=None: str(tmp_path))
    with pytest.raises(S.SetupError, match=f"imports from {tmp_path}; run without --check-only"):
        S.ensure_fasttrain(check_only=True)
    monkeypatch.setattr(S, "fasttrain_location", lambda extra_path=None: None)
    with pytest.raises(S.SetupError, match="does not import"):
        S.ensure_fasttrain(check_only=True)


def test_pip_failure_shows_the_builds_own_error():
    output = "  running dist_info\n      error: invalid command 'bdist_wheel'\nerror: metadata-generation-failed\nhint: See above"
    assert S.pip_error_line(output, 1) == "error: invalid command 'bdist_wheel'"
    assert S.pip_error_line("", 3) == "pip exited 3"


def test_old_setuptools_without_wheel_is_named():
    assert "needs the 'wheel' package" in S.build_backend_problem("65.5.0", has_wheel=False)
    assert S.build_backend_problem("65.5.0", has_wheel=True) is None
    assert S.build_backend_problem("84.2.1", has_wheel=False) is None


def test_carried_wheels_are_installed_before_anything_is_checked(tmp_path, monkeypatch):
    """A package the machine lacks but the wheels folder carries counts as present."""
    wheels, target = tmp_path / "wheels", tmp_path / "site"
    wheels.mkdir()
    _wheel(str(wheels), name="carriedpkg_for_setup_test")
    monkeypatch.setattr(S, "REQUIRED", dict(S.REQUIRED, carriedpkg_for_setup_test="carriedpkg"))
    monkeypatch.setattr(sys, "path", list(sys.path))
    notes = S.setup("cpu", str(wheels), str(target), check_only=False)
    assert notes[0] == f"installed 1 wheel(s) from {wheels} into {target}"
    assert (target / "carriedpkg_for_setup_test" / "__init__.py").exists()
    # without the wheel the same package is reported missing, in one line
    monkeypatch.setattr(S, "REQUIRED", dict(S.REQUIRED, other_absent_pkg_xyz="other-absent"))
    with pytest.raises(S.SetupError, match="missing Python packages: other-absent"):
        S.setup("cpu", str(wheels), str(tmp_path / "site2"), check_only=False)

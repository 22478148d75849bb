"""scripts/uv_install.py hands uv what pip's configuration says (the Makefile installs
with uv): pip's precedence between variables, [install] and [global], and every item of
a list-valued setting."""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "scripts"))
import uv_install  # noqa: E402

LISTING = """\
:env:.find-links='/opt/wheels'
:env:.default-timeout='180'
global.cert='/etc/ssl/certs/ca-certificates.crt'
global.constraint='/etc/xdg/pip/constraints.txt'
global.extra-index-url='file:///opt/pypi/simple file:///opt/pypi-more/simple'
global.find-links='/ignored/because/env/wins'
global.index-url='https://global.example/simple'
install.index-url='https://install.example/simple'
install.no-index='false'
global.trusted-host="it's.example"
freeze.index-url='https://not-for-install.example/simple'
"""


def test_pip_precedence_and_every_list_item():
  settings = uv_install.pip_settings(LISTING)
  assert settings["find-links"] == "/opt/wheels"  # PIP_FIND_LINKS over [global]
  assert settings["index-url"] == "https://install.example/simple"  # [install] over [global]
  flags, env = uv_install.uv_options(settings)
  assert flags == ["--index-url=https://install.example/simple",
                   "--extra-index-url=file:///opt/pypi/simple",
                   "--extra-index-url=file:///opt/pypi-more/simple",
                   "--find-links=/opt/wheels",
                   "--constraint=/etc/xdg/pip/constraints.txt",
                   "--allow-insecure-host=it's.example"]  # pip prints repr(value)
  assert env == {"SSL_CERT_FILE": "/etc/ssl/certs/ca-certificates.crt",
                 "UV_HTTP_TIMEOUT": "180"}


def test_no_index_and_an_empty_configuration():
  assert uv_install.uv_options(uv_install.pip_settings(""))[0] == []
  flags, _ = uv_install.uv_options(uv_install.pip_settings(":env:.no-index='yes'\n"))
  assert flags == ["--no-index"]


def test_no_pip_config_keeps_the_certificate_and_drops_package_sources(monkeypatch, tmp_path):
  """scripts/check_installs.py resolves as a host without this machine's wheel
  directory and caps would: `--no_pip_config` drops the sources, keeps cert and timeout."""
  (tmp_path / "uv").touch()
  monkeypatch.setattr(uv_install.sys, "executable", str(tmp_path / "python"))
  calls = []

  class Done:
    stdout, returncode = LISTING, 0

  def run(cmd, **kw):
    calls.append((cmd, kw.get("env")))
    return Done()

  monkeypatch.setattr(uv_install.subprocess, "run", run)
  assert uv_install.main(["--no_pip_config", "--dry-run", "-r", "r.txt"]) == 0
  cmd, env = calls[-1]
  assert cmd[-3:] == ["--dry-run", "-r", "r.txt"] and "--no_pip_config" not in cmd
  assert not [a for a in cmd if a.startswith(("--find-links", "--constraint", "--index-url",
                                               "--extra-index-url"))]
  assert env["SSL_CERT_FILE"] == "/etc/ssl/certs/ca-certificates.crt"
  uv_install.main(["-r", "r.txt"])
  assert "--find-links=/opt/wheels" in calls[-1][0]

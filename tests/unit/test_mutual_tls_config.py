"""Mutual TLS and Redis security settings without a server: ``tls.client_auth``'s rules at
load, what each door is handed (gRPC credentials, uvicorn options, SSL contexts, redis-py
options), ``redis_password`` folded into the URL and kept off command lines and records, and
``rlfleet certs``: a CA and per-role certificates that verify, name the right hosts, serve and
dial, and keep their keys private."""

from __future__ import annotations

import ssl
import stat
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID

from rlfleet.common import tls
from rlfleet.common.config import load_config
from rlfleet.common.config.root import RlfleetConfig, with_password
from rlfleet.common.config.security import TlsConfig
from rlfleet.common.entry import record_config, safe_url
from rlfleet.launch import certs
from rlfleet.launch.pki import make_fleet
from rlfleet.launch.process import split_secrets


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("certs")
    make_fleet(directory, ["reward", "client"], ["node-7", "10.1.2.3"], days=2)
    return directory


def mutual(directory: Path, name: str) -> TlsConfig:
    files = {"cert_file": f"{directory}/{name}.pem", "key_file": f"{directory}/{name}.key"}
    return TlsConfig(**files, ca_file=f"{directory}/ca.pem", client_auth=True)


def test_client_auth_needs_a_ca_and_a_certificate(fleet: Path) -> None:
    with pytest.raises(ValueError, match="tls.client_auth needs tls.ca_file"):
        TlsConfig(ca_file=str(fleet / "ca.pem"), client_auth=True)
    with pytest.raises(ValueError, match="rlfleet certs"):
        TlsConfig(
            cert_file=str(fleet / "reward.pem"),
            key_file=str(fleet / "reward.key"),
            client_auth=True,
        )
    config = load_config(
        None, [f"tls.{k}={v}" for k, v in mutual(fleet, "reward").model_dump().items() if v]
    )
    assert config.tls.client_auth and config.tls.serving


def test_each_door_asks_for_a_client_certificate_only_with_client_auth(fleet: Path) -> None:
    strict, plain_tls = (
        mutual(fleet, "reward"),
        mutual(fleet, "reward").model_copy(update={"client_auth": False}),
    )
    assert tls.http_options(strict)["ssl_cert_reqs"] == ssl.CERT_REQUIRED
    assert tls.http_options(strict)["ssl_ca_certs"] == str(fleet / "ca.pem")
    assert "ssl_cert_reqs" not in tls.http_options(plain_tls)
    assert tls.server_ssl_context(strict).verify_mode == ssl.CERT_REQUIRED
    assert tls.server_ssl_context(plain_tls).verify_mode == ssl.CERT_NONE
    assert (
        tls.server_ssl_context(TlsConfig()) is None and tls.client_ssl_context(TlsConfig()) is None
    )
    assert (
        tls.server_credentials(strict) is not None and tls.channel_credentials(strict) is not None
    )
    assert tls.scheme(strict) == "https" and tls.scheme(TlsConfig()) == "http"


def test_a_client_context_presents_its_certificate_and_trusts_the_fleet(fleet: Path) -> None:
    context = tls.client_ssl_context(mutual(fleet, "client"))
    assert context.verify_mode == ssl.CERT_REQUIRED and context.check_hostname
    assert [c["subject"] for c in context.get_ca_certs()] == [((("commonName", ca_name(fleet)),),)]
    with_roots = tls.client_ssl_context(mutual(fleet, "client"), system_roots=True)
    assert len(with_roots.get_ca_certs()) >= 1


def ca_name(directory: Path) -> str:
    cert = x509.load_pem_x509_certificate((directory / "ca.pem").read_bytes())
    return cert.subject.rfc4514_string().removeprefix("CN=")


def test_redis_options_follow_the_url_scheme(fleet: Path) -> None:
    client = mutual(fleet, "client")
    assert tls.redis_options("redis://127.0.0.1:7000/0", client) == {}
    options = tls.redis_options("rediss://127.0.0.1:7000/0", client)
    assert options == {
        "ssl_ca_certs": str(fleet / "ca.pem"),
        "ssl_certfile": str(fleet / "client.pem"),
        "ssl_keyfile": str(fleet / "client.key"),
    }
    assert tls.redis_options("rediss://h:1/0", TlsConfig()) == {}  # the system's roots


def test_a_refused_handshake_says_what_to_check(fleet: Path) -> None:
    closed = (
        "failed to connect to all addresses; last error: UNAVAILABLE: ipv4:1.2.3.4:5: Socket closed"
    )
    no_cert = TlsConfig(ca_file=str(fleet / "ca.pem"))
    assert "needs a client certificate" in tls.refusal_hint(closed, no_cert)
    assert "signed tls.cert_file" in tls.refusal_hint(closed, mutual(fleet, "client"))
    assert tls.refusal_hint("Connection refused", no_cert) == ""
    assert tls.refusal_hint(closed, TlsConfig()) == ""  # plaintext: nothing about TLS


def test_redis_password_goes_into_the_url_once() -> None:
    assert with_password("redis://h:6379/0", "p@ss:w/rd") == "redis://:p%40ss%3Aw%2Frd@h:6379/0"
    assert with_password("rediss://u@h:1/0", "x") == "rediss://u:x@h:1/0"
    assert with_password("redis://:x@h:1/0", "x") == "redis://:x@h:1/0"
    with pytest.raises(ValueError, match="differs"):
        with_password("redis://:y@h:1/0", "x")
    assert (
        with_password("unix:///run/r.sock?db=2", "a&b") == "unix:///run/r.sock?db=2&password=a%26b"
    )
    assert with_password("unix:///run/r.sock?password=x", "x") == "unix:///run/r.sock?password=x"
    assert (
        safe_url("unix:///run/r.sock?db=2&password=a%26b") == "unix:///run/r.sock?db=2&password=***"
    )
    config = RlfleetConfig(redis_url="rediss://h:1/0", redis_password="s3cret")
    assert config.redis_url == "rediss://:s3cret@h:1/0"
    assert RlfleetConfig(redis_password="s3cret").redis_url is None  # the embedded one takes it


def test_redis_password_from_the_environment_never_on_a_command_line(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("RLFLEET_REDIS_PASSWORD", "from-env")
    config = load_config(None, ["redis_url=redis://h:1/0", f"run_dir={tmp_path}"])
    assert config.redis_url == "redis://:from-env@h:1/0" and "from-env" not in safe_url(
        config.redis_url
    )
    plain, env = split_secrets(["redis_password=typed", "cluster=c"])
    assert plain == ["cluster=c"] and env == {"RLFLEET_REDIS_PASSWORD": "typed"}
    recorded = record_config(config, "reward").read_text()
    assert "from-env" not in recorded and "redis_password: '***'" in recorded


def test_certs_make_a_ca_and_role_certificates_that_verify(fleet: Path) -> None:
    ca = x509.load_pem_x509_certificate((fleet / "ca.pem").read_bytes())
    assert ca.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    reward = x509.load_pem_x509_certificate((fleet / "reward.pem").read_bytes())
    reward.verify_directly_issued_by(ca)
    names = reward.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert set(names.get_values_for_type(x509.DNSName)) == {"localhost", "reward", "node-7"}
    assert {str(ip) for ip in names.get_values_for_type(x509.IPAddress)} == {
        "127.0.0.1",
        "::1",
        "10.1.2.3",
    }
    usage = reward.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert {ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH} <= set(usage)
    assert not reward.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    assert isinstance(reward.public_key(), ec.EllipticCurvePublicKey)
    for key in ("ca.key", "reward.key", "client.key"):
        assert stat.S_IMODE((fleet / key).stat().st_mode) == 0o600
    ssl.create_default_context(cafile=str(fleet / "ca.pem")).load_cert_chain(
        fleet / "reward.pem", fleet / "reward.key"
    )


def test_certs_reuse_the_ca_and_refuse_to_overwrite(
    fleet: Path, capsys: pytest.CaptureFixture
) -> None:
    before = (fleet / "ca.pem").read_bytes()
    assert certs.main([str(fleet), "--roles", "rollout-9", "--hosts", "gpu9"]) == 0
    said = capsys.readouterr().out
    assert "the CA already there" in said and f"ca_file: {fleet.resolve()}/ca.pem" in said
    assert "client_auth: true" in said and "--tls-auth-clients yes" in said
    assert (fleet / "ca.pem").read_bytes() == before
    added = x509.load_pem_x509_certificate((fleet / "rollout-9.pem").read_bytes())
    added.verify_directly_issued_by(x509.load_pem_x509_certificate(before))
    assert certs.main([str(fleet), "--roles", "reward"]) == 2
    assert "already holds reward" in capsys.readouterr().err
    assert certs.main([str(fleet), "--roles", "ca"]) == 2


def test_certs_help_does_not_import_cryptography() -> None:
    import subprocess
    import sys

    probe = "import sys; from rlfleet.launch import certs; certs.parse(['d']); print('cryptography' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"

"""Certificates for tests, made with trustme: a cluster CA, certificates it signs, and
certificates from another CA (which nobody in the cluster trusts)."""

from __future__ import annotations

import pathlib

import trustme


def make_pki(directory: pathlib.Path, ours: list[str], foreign: list[str] = ()) -> dict:
    """{"ca": CA file, name: (cert file, key file)} for every name; `ours` are signed by the
    CA, `foreign` by another one. Every certificate is for 127.0.0.1 and localhost."""
    ca, other = trustme.CA(), trustme.CA()
    files: dict = {"ca": str(directory / "ca.pem")}
    ca.cert_pem.write_to_path(files["ca"])
    for names, issuer in ((ours, ca), (foreign, other)):
        for name in names:
            cert = issuer.issue_cert("127.0.0.1", "localhost")
            files[name] = (str(directory / f"{name}.pem"), str(directory / f"{name}.key"))
            cert.cert_chain_pems[0].write_to_path(files[name][0])
            cert.private_key_pem.write_to_path(files[name][1])
    return files

"""A throwaway PKI for the TLS tests (trustme): one CA, its certificates, a stranger, a token."""

from __future__ import annotations

from pathlib import Path

import trustme

TOKEN = "run-token-42"


def make_pki(directory: Path) -> dict[str, str]:
    """Writes into ``directory`` and returns the paths, by key:

    * ``ca``: the CA's certificate;
    * ``server_cert``/``server_key``: from the CA, for localhost and 127.0.0.1 (every process
      of a run listens on 127.0.0.1 and is dialled by that address);
    * ``client_cert``/``client_key``: a client certificate from the CA;
    * ``stranger_ca``, ``stranger_cert``/``stranger_key``: another CA and a certificate from
      it (for localhost and 127.0.0.1), which nothing here trusts;
    * ``token``: a file holding :data:`TOKEN`.
    """
    ca, stranger_ca = trustme.CA(), trustme.CA()
    server = ca.issue_cert("localhost", "127.0.0.1")
    client = ca.issue_cert("areal-client")
    stranger = stranger_ca.issue_cert("localhost", "127.0.0.1")
    files = {
        "ca": directory / "ca.pem",
        "server_cert": directory / "server.pem",
        "server_key": directory / "server.key",
        "client_cert": directory / "client.pem",
        "client_key": directory / "client.key",
        "stranger_ca": directory / "stranger_ca.pem",
        "stranger_cert": directory / "stranger.pem",
        "stranger_key": directory / "stranger.key",
        "token": directory / "token",
    }
    ca.cert_pem.write_to_path(files["ca"])
    server.cert_chain_pems[0].write_to_path(files["server_cert"])
    server.private_key_pem.write_to_path(files["server_key"])
    client.cert_chain_pems[0].write_to_path(files["client_cert"])
    client.private_key_pem.write_to_path(files["client_key"])
    stranger_ca.cert_pem.write_to_path(files["stranger_ca"])
    stranger.cert_chain_pems[0].write_to_path(files["stranger_cert"])
    stranger.private_key_pem.write_to_path(files["stranger_key"])
    files["token"].write_text(TOKEN + "\n")
    return {k: str(v) for k, v in files.items()}

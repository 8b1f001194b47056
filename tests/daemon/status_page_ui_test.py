#!/usr/bin/env python3
"""The coordinator's status page (`--http-listen`) for real, and `wsyncctl history --plot`.

1. A running cluster (coordinator with --http-listen, a reference engine pair behind a target wsyncd, a source wsyncd,
   one trainer rank driving 2 real updates whose bytes the trainer verifies on both engines): headless Chromium
   (Debian's `chromium`, installed with apt-get when missing) loads the page, dumps the DOM it built and takes a
   screenshot. The DOM must hold a bar per phase of each update (per engine and per source too) and every
   membership/engine row; the screenshot must not be blank and must show the push bars' colour.
2. `wsyncctl history --plot`: SVG (well-formed XML, the same bars), PNG through rsvg-convert (Debian's librsvg2-bin,
   installed when missing; a non-blank image), and a version not in the history refused naming the versions held.
3. The same cluster under mTLS (every process with a certificate of tools/cli/wsync-certs.sh's CA): headless Chromium
   presents an `admin` client certificate of the cluster CA and loads the HTTPS page (the same DOM and screenshot
   checks); the same Chromium without a client certificate, or with another CA's, gets no page (the handshake's
   refusal, net::ERR_...); a Python TLS client likewise, and plain HTTP to the HTTPS port gets a plain-text 400 naming https://; a certificate
   of the cluster CA whose CN names no wsync role passes the handshake and gets 403. Then the coordinator's TLS files
   are rotated (a new server certificate, a CA bundle adding the other CA): without a restart the page presents the
   new certificate and serves the other CA's client.

How Chromium gets its certificate: Chromium on Linux keeps certificates in the NSS database $HOME/.pki/nssdb, so each
Chromium run here gets its own HOME inside the work directory with a database made by `certutil`/`pk12util` (Debian's
libnss3-tools, installed when missing) that trusts the cluster CA and holds the client key and certificate (PKCS#12
from `openssl pkcs12`). Headless Chromium shows no certificate chooser: with a certificate in the database and no
selection rule it waits forever. The rule is the profile's `auto_select_certificate` content setting (the one the
AutoSelectCertificateForUrls policy sets), written into the profile's own Preferences file before Chromium starts.
That needs no policy file under /etc/chromium/policies (no mount namespace, nothing changed on the machine), and it
is the same rule for all three runs: what differs is only the certificate in the database.
"""
import argparse
import json
import os
import re
import shutil
import socket
import ssl
import struct
import subprocess
import sys
import urllib.error
import urllib.request
import xml.etree.ElementTree as ET
import zlib

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "engines"))
import harness  # noqa: E402

ROOT = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
PUSH_RGB = (0x4E, 0x79, 0xA7)  # the push phase's colour in daemon/coordinator/timeline_svg.cc


def ensure(binary: str, package: str) -> str:
    """The path of `binary`, installing Debian's `package` with apt-get when it is missing (a failure, not a skip)."""
    path = shutil.which(binary)
    if path:
        return path
    print(f"status_page_ui_test: {binary} is missing; installing Debian's {package}", flush=True)
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    sudo = [] if os.geteuid() == 0 else ["sudo", "-n"]
    subprocess.run(sudo + ["apt-get", "update", "-qq"], env=env, check=True)
    subprocess.run(sudo + ["apt-get", "install", "-y", "-qq", "--no-install-recommends", package], env=env, check=True,
                   stdout=subprocess.DEVNULL)
    path = shutil.which(binary)
    if not path:
        raise RuntimeError(f"{package} was installed but {binary} is not on PATH")
    return path


def png_pixels(path: str):
    """(width, height, rows of RGB tuples) of an 8-bit RGB/RGBA/grey PNG, non-interlaced (what Chromium and
    rsvg-convert write): a small reader, so the test needs no imaging library."""
    data = open(path, "rb").read()
    if data[:8] != b"\x89PNG\r\n\x1a\n":
        raise ValueError(f"{path} is not a PNG")
    pos, idat, ihdr = 8, b"", None
    while pos < len(data):
        n, kind = struct.unpack(">I4s", data[pos:pos + 8])
        body = data[pos + 8:pos + 8 + n]
        if kind == b"IHDR":
            ihdr = struct.unpack(">IIBBBBB", body)
        elif kind == b"IDAT":
            idat += body
        pos += 12 + n
    w, h, depth, color, _, _, interlace = ihdr
    channels = {0: 1, 2: 3, 4: 2, 6: 4}[color]
    if depth != 8 or interlace != 0:
        raise ValueError(f"{path}: bit depth {depth}, interlace {interlace} not handled")
    raw = zlib.decompress(idat)
    stride = w * channels
    rows, prev, i = [], bytearray(stride), 0
    for _ in range(h):
        f, line = raw[i], bytearray(raw[i + 1:i + 1 + stride])
        i += 1 + stride
        for x in range(stride):
            a = line[x - channels] if x >= channels else 0
            b, c = prev[x], prev[x - channels] if x >= channels else 0
            if f == 1:
                line[x] = (line[x] + a) & 0xFF
            elif f == 2:
                line[x] = (line[x] + b) & 0xFF
            elif f == 3:
                line[x] = (line[x] + (a + b) // 2) & 0xFF
            elif f == 4:
                p = a + b - c
                pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
                line[x] = (line[x] + (a if pa <= pb and pa <= pc else b if pb <= pc else c)) & 0xFF
        rows.append(line)
        prev = line
    px = []
    for line in rows:
        if channels >= 3:
            px.append([tuple(line[x * channels:x * channels + 3]) for x in range(w)])
        else:
            px.append([(line[x * channels],) * 3 for x in range(w)])
    return w, h, px


def pixel_counts(path: str):
    """(non-white pixels, pixels of the push colour) of a PNG."""
    _, _, px = png_pixels(path)
    nonwhite = push = 0
    for row in px:
        for p in row:
            if p != (255, 255, 255):
                nonwhite += 1
            if all(abs(p[k] - PUSH_RGB[k]) <= 6 for k in range(3)):
                push += 1
    return nonwhite, push


def phase_rects(markup: str):
    """[(version, row, phase)] of every timeline bar in HTML or SVG text."""
    out = []
    for attrs in re.findall(r'<rect class="phase"([^>]*)>', markup):
        a = dict(re.findall(r'([a-z-]+)="([^"]*)"', attrs))
        out.append((a.get("data-version"), a.get("data-row"), a.get("data-phase")))
    return out


def check_timeline(check, bars, versions, what):
    for v in versions:
        mine = [b for b in bars if b[0] == str(v)]
        update = [b[2] for b in mine if b[1] == "update"]
        # The first update configures the source (a new plan); the second, with the plan unchanged, does not.
        for phase in ("pause", "configure" if v == 1 else "push", "push", "post_process", "set_version", "continue"):
            check(phase in update, f"{what}: update {v} has its {phase} phase")
        check(("%d" % v, "source:train0", "push") in mine, f"{what}: update {v} has source train0's push")
        for e in ("engine0", "engine1"):
            for phase in ("pause", "post_process", "continue"):
                check(("%d" % v, f"engine:{e}", phase) in mine, f"{what}: update {v} has {e}'s {phase} call")


class Browser:
    """A headless Chromium with its own profile and, under TLS, its own NSS database (HOME)."""

    def __init__(self, binary: str, profile: str, home: str | None = None):
        self.binary, self.profile, self.home = binary, profile, home

    def run(self, url: str, *args: str) -> subprocess.CompletedProcess:
        env = dict(os.environ)
        if self.home:
            env["HOME"] = self.home  # Chromium reads $HOME/.pki/nssdb
        return subprocess.run([self.binary, "--headless=new", "--no-sandbox", "--disable-gpu",
                               "--disable-dev-shm-usage", "--no-first-run", "--hide-scrollbars",
                               f"--user-data-dir={self.profile}", "--window-size=1280,1800", *args, url],
                              capture_output=True, text=True, timeout=90, env=env)


def subject_cn(pem: str) -> str:
    out = subprocess.run(["openssl", "x509", "-in", pem, "-noout", "-subject", "-nameopt", "multiline"],
                         capture_output=True, text=True, check=True).stdout
    m = re.search(r"commonName\s*=\s*(.+)", out)
    if not m:
        raise RuntimeError(f"{pem}: no subject CN in {out!r}")
    return m.group(1).strip()


def tls_browser(chrome: str, wd: str, name: str, ca_dir: str, origin: str, cert_dir: str | None,
                who: str = "admin-ui") -> Browser:
    """A Chromium whose NSS database trusts `ca_dir`'s CA and holds `cert_dir`'s `who` certificate (none when
    cert_dir is None), with the profile rule that selects a client certificate for `origin` by its issuer's CN."""
    home, profile = os.path.join(wd, f"{name}-home"), os.path.join(wd, f"{name}-profile")
    nssdb = os.path.join(home, ".pki", "nssdb")
    os.makedirs(nssdb)
    os.makedirs(os.path.join(profile, "Default"))
    db = f"sql:{nssdb}"
    subprocess.run(["certutil", "-N", "-d", db, "--empty-password"], check=True, capture_output=True)
    subprocess.run(["certutil", "-A", "-d", db, "-n", "wsync-cluster-ca", "-t", "C,,", "-i", f"{ca_dir}/ca.pem"],
                   check=True, capture_output=True)
    if cert_dir:
        p12 = os.path.join(wd, f"{name}.p12")
        subprocess.run(["openssl", "pkcs12", "-export", "-in", f"{cert_dir}/{who}.pem", "-inkey",
                        f"{cert_dir}/{who}-key.pem", "-name", f"{name}-{who}", "-passout", "pass:", "-out", p12],
                       check=True, capture_output=True)
        subprocess.run(["pk12util", "-d", db, "-i", p12, "-W", ""], check=True, capture_output=True)
    # The rule names the issuer of the certificate in the database (another CA's in the refusal case), so that
    # Chromium presents it: the refusal must come from the server, not from Chromium holding the certificate back.
    rule = {"filters": [{"ISSUER": {"CN": subject_cn(f"{cert_dir or ca_dir}/ca.pem")}}]}
    prefs = {"profile": {"content_settings": {"exceptions": {"auto_select_certificate": {
        f"{origin},*": {"setting": rule}}}}}}
    with open(os.path.join(profile, "Default", "Preferences"), "w") as f:
        json.dump(prefs, f)
    return Browser(chrome, profile, home)


def page_checks(check, browser: Browser, base: str, wd: str, what: str) -> None:
    """Chromium loads the page of the cluster after its 2 updates: the DOM's bars, rows and a non-blank screenshot."""
    dom = browser.run(f"{base}/", "--dump-dom")
    check(dom.returncode == 0 and "<svg" in dom.stdout,
          f"{what}: Chromium loads the page and builds its DOM" +
          ("" if dom.returncode == 0 and "<svg" in dom.stdout else f": {load_error(dom)}"))
    bars = phase_rects(dom.stdout)
    check(len(bars) >= 2 * (6 + 1 + 2 * 4), f"{what}: the timeline in Chromium's DOM has the bars of both updates "
          f"({len(bars)})")
    check_timeline(check, bars, (1, 2), f"{what}, Chromium's DOM")
    for node in ("train0", "infer0", "infer1"):
        check(f"<td>{node}</td>" in dom.stdout, f"{what}: membership lists {node}")
    for e in ("engine0", "engine1"):
        m = re.search(rf'<tr data-engine="{e}">(.*?)</tr>', dom.stdout)
        check(m is not None and "<td>2</td>" in m.group(1) and ">ready<" in m.group(1),
              f"{what}: {e}: version 2, ready")
    shot = os.path.join(wd, f"page-{what.replace(' ', '-')}.png")
    s = browser.run(f"{base}/", f"--screenshot={shot}")
    check(s.returncode == 0 and os.path.exists(shot), f"{what}: Chromium takes a screenshot")
    if os.path.exists(shot):
        nonwhite, push = pixel_counts(shot)
        print(f"{what} screenshot: {nonwhite} non-white pixels, {push} of the push colour", flush=True)
        check(nonwhite > 20000, f"{what}: the screenshot is not blank")
        check(push > 500, f"{what}: the screenshot shows the push bars")


def load_error(r: subprocess.CompletedProcess) -> str:
    """The network error headless Chromium reports for a page it could not load (e.g. net::ERR_...)."""
    m = re.search(r"net::ERR_\w+", r.stderr)
    return m.group(0) if m else f"exit {r.returncode}, no net::ERR_ line: {r.stderr[-1500:]}"


class Tls:
    """The certificates of the mTLS run: the cluster CA's for every process, and another CA's."""

    def __init__(self, wd: str):
        self.certs, self.foreign = os.path.join(wd, "certs"), os.path.join(wd, "foreign")
        gen = os.path.join(ROOT, "tools", "cli", "wsync-certs.sh")
        subprocess.run([gen, self.certs, "coordinator:ui", "engine:engine0", "engine:engine1", "target:infer0",
                        "target:infer1", "source:train0", "trainer:ui", "admin:ui"], check=True,
                       stdout=subprocess.DEVNULL)
        subprocess.run([gen, self.foreign, "admin:ui"], check=True, stdout=subprocess.DEVNULL)

    def flags(self, who: str) -> list[str]:
        return ["--tls-ca", f"{self.certs}/ca.pem", "--tls-cert", f"{self.certs}/{who}.pem", "--tls-key",
                f"{self.certs}/{who}-key.pem"]

    def context(self, cert_dir: str | None, who: str = "admin-ui") -> ssl.SSLContext:
        ctx = ssl.create_default_context(cafile=f"{self.certs}/ca.pem")
        if cert_dir:
            ctx.load_cert_chain(f"{cert_dir}/{who}.pem", f"{cert_dir}/{who}-key.pem")
        return ctx

    def not_a_role(self) -> str:
        """A certificate of the cluster CA whose CN names no wsync role (wsync-certs.sh makes only roles): its file
        stem in self.certs."""
        stem, base = "operator-ui", os.path.join(self.certs, "operator-ui")
        subprocess.run(["openssl", "req", "-new", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes",
                        "-keyout", f"{base}-key.pem", "-subj", "/O=wsync/CN=operator:ui", "-out", f"{base}.csr"],
                       check=True, capture_output=True)
        subprocess.run(["openssl", "x509", "-req", "-in", f"{base}.csr", "-CA", f"{self.certs}/ca.pem", "-CAkey",
                        f"{self.certs}/ca-key.pem", "-set_serial", "4242", "-days", "2", "-out", f"{base}.pem"],
                       check=True, capture_output=True)
        return stem


def cluster_checks(check, b: str, model: str, wd: str, chrome: str, tls: Tls | None) -> None:
    """A running cluster with 2 verified updates, its page in Chromium; plain HTTP when tls is None, else mTLS."""
    mode = "mTLS" if tls else "plain"
    wd = os.path.join(wd, mode)
    os.makedirs(wd)
    flags = tls.flags if tls else (lambda who: [])
    procs = harness.Procs(wd)
    try:
        def port_of(name: str) -> int:
            path = os.path.join(wd, f"{name}.port")
            return harness.wait_for(f"{name} port", lambda: harness.read_port_file(path), 60, procs, [name], 0.05)

        page_port = harness.free_port()
        procs.start("coordinator", [f"{b}/wsync-coordinator", "--listen", "127.0.0.1:0", "--port-file",
                                    os.path.join(wd, "coordinator.port"), "--http-listen", f"127.0.0.1:{page_port}"]
                    + flags("coordinator-ui") + (["--tls-refresh-seconds", "1"] if tls else []))
        coord = f"127.0.0.1:{port_of('coordinator')}"
        engines = []
        for e in ("engine0", "engine1"):
            procs.start(e, [f"{b}/wsync-engine-ref", "--id", e, "--model", model, "--tp", "1", "--listen",
                            "127.0.0.1:0", "--port-file", os.path.join(wd, f"{e}.port")] + flags(f"engine-{e}"))
            engines.append(f"127.0.0.1:{port_of(e)}")
        for i, eng in enumerate(engines):
            procs.start(f"target{i}", [f"{b}/wsyncd", "--listen", "127.0.0.1:0", "--role", "target", "--node-id",
                                       f"infer{i}", "--coordinator", coord, "--engine", f"reference+grpc://{eng}",
                                       "--engine-socket", os.path.join(wd, f"target{i}.sock"), "--port-file",
                                       os.path.join(wd, f"target{i}.port")] + flags(f"target-infer{i}"))
            port_of(f"target{i}")
        procs.start("source", [f"{b}/wsyncd", "--listen", "127.0.0.1:0", "--role", "source", "--node-id", "train0",
                               "--coordinator", coord, "--trainer-socket", os.path.join(wd, "source.sock"),
                               "--trainer-ranks", "1", "--ring-mib", "16", "--port-file",
                               os.path.join(wd, "source.port")] + flags("source-train0"))
        port_of("source")
        # The trainer verifies every engine's bytes against its own weights after each update (--verify-engine).
        trainer = subprocess.run(
            [f"{b}/wsync-trainer-demo", "--daemon", os.path.join(wd, "source.sock"), "--model", model,
             "--local-rank", "0", "--global-rank", "0", "--updates", "2", "--drive", "--coordinator", coord]
            + [x for eng in engines for x in ("--verify-engine", eng)] + flags("trainer-ui"),
            capture_output=True, text=True, timeout=120)
        check(trainer.returncode == 0, f"{mode}: 2 updates pushed, committed and verified on both engines"
              + ("" if trainer.returncode == 0 else f":\n{trainer.stdout[-2000:]}\n{trainer.stderr[-2000:]}"))

        if tls is None:
            base = f"http://127.0.0.1:{page_port}"
            html = urllib.request.urlopen(f"{base}/", timeout=10).read().decode()
            check("<script" not in html, "the page carries no script")
            page_checks(check, Browser(chrome, os.path.join(wd, "chromium-profile")), base, wd, mode)
            svg = urllib.request.urlopen(f"{base}/timeline.svg?n=1", timeout=10)
            body = svg.read().decode()
            check(svg.headers.get("Content-Type", "").startswith("image/svg+xml") and
                  {r[0] for r in phase_rects(body)} == {"2"}, "/timeline.svg?n=1: the last update only, as SVG")
            # Read-only: a write method is not served.
            for method in ("POST", "PUT", "DELETE"):
                try:
                    with urllib.request.urlopen(urllib.request.Request(f"{base}/", data=b"x", method=method),
                                                timeout=10) as r:
                        check(False, f"{method} /: refused (got HTTP {r.status})")
                except urllib.error.HTTPError as e:
                    check(400 <= e.code < 500, f"{method} /: refused (HTTP {e.code})")
            plot_checks(check, b, coord, wd)
        else:
            tls_page_checks(check, chrome, tls, page_port, wd, procs)
    finally:
        procs.close()


def plot_checks(check, b: str, coord: str, wd: str) -> None:
    """wsyncctl history --plot: SVG, PNG, and a version the history does not hold."""
    ctl = [f"{b}/wsyncctl", "--endpoints", coord, "history"]
    out_svg = os.path.join(wd, "updates.svg")
    r = subprocess.run(ctl + ["--plot", out_svg], capture_output=True, text=True, timeout=30)
    check(r.returncode == 0 and os.path.exists(out_svg), "history --plot FILE.svg" + ("" if r.returncode == 0
                                                                                      else f": {r.stderr}"))
    if os.path.exists(out_svg):
        text = open(out_svg).read()
        try:
            ET.fromstring(text)
            check(True, "the plot is well-formed XML")
        except ET.ParseError as e:
            check(False, f"the plot is well-formed XML ({e})")
        check_timeline(check, phase_rects(text), (1, 2), "history --plot")
    out_png = os.path.join(wd, "v2.png")
    r = subprocess.run(ctl + ["--plot", out_png, "--version", "2"], capture_output=True, text=True, timeout=30)
    check(r.returncode == 0 and os.path.exists(out_png), "history --plot FILE.png --version 2" +
          ("" if r.returncode == 0 else f": {r.stderr}"))
    if os.path.exists(out_png):
        nonwhite, push = pixel_counts(out_png)
        check(nonwhite > 5000 and push > 200, f"the PNG is a drawing ({nonwhite} non-white, {push} push pixels)")
    r = subprocess.run(ctl + ["--plot", os.path.join(wd, "x.svg"), "--version", "7"], capture_output=True,
                       text=True, timeout=30)
    check(r.returncode == 1 and "version 7 is not in the coordinator's history" in r.stderr
          and "holds versions 1-2" in r.stderr, f"a version not in the history is refused, naming those held "
          f"(exit {r.returncode}: {r.stderr.strip()})")
    check(not os.path.exists(os.path.join(wd, "x.svg")), "and no file is written")
    r = subprocess.run(ctl + ["--plot", os.path.join(wd, "x.pdf")], capture_output=True, text=True, timeout=30)
    check(r.returncode == 2 and ".svg" in r.stderr, "--plot x.pdf: a usage error naming the formats")


def tls_page_checks(check, chrome: str, tls: Tls, page_port: int, wd: str, procs: harness.Procs) -> None:
    """The HTTPS page of the mTLS cluster: Chromium with the cluster CA's admin certificate loads it; Chromium without
    a client certificate or with another CA's, a Python client likewise, and plain HTTP get no page."""
    origin = f"https://127.0.0.1:{page_port}"
    # WSYNC_UI_TEST_NO_CLIENT_CERT=1 leaves the certificate out of the first browser's database: the page checks
    # below must then fail (how this test is checked to depend on Chromium presenting the certificate).
    admin_cert = None if os.environ.get("WSYNC_UI_TEST_NO_CLIENT_CERT") == "1" else tls.certs
    page_checks(check, tls_browser(chrome, wd, "chromium-admin", tls.certs, origin, admin_cert), origin, wd, "mTLS")
    for name, cert_dir, what in (("chromium-nocert", None, "Chromium without a client certificate"),
                                 ("chromium-foreign", tls.foreign, "Chromium with another CA's certificate")):
        r = tls_browser(chrome, wd, name, tls.certs, origin, cert_dir).run(f"{origin}/", "--dump-dom")
        # Which error Chromium reports depends on when the server's refusal reaches it: with TLS 1.3 the client's
        # side of the handshake ends before the server checks the certificate, so the alert
        # (ERR_BAD_SSL_CLIENT_AUTH_CERT) may arrive after the connection is gone (ERR_SOCKET_NOT_CONNECTED,
        # ERR_CONNECTION_RESET/CLOSED). Any of them is a load failure: no DOM, no page.
        err = load_error(r)
        check("wsync coordinator" not in r.stdout and "<svg" not in r.stdout and
              re.fullmatch(r"net::ERR_\w+", err) is not None, f"{what}: no page, the connection is refused ({err})")

    def get(cert_dir, who="admin-ui"):
        with urllib.request.urlopen(f"{origin}/", timeout=10, context=tls.context(cert_dir, who)) as r:
            return r.status, r.read().decode()

    status, body = get(tls.certs)
    check(status == 200 and "wsync coordinator" in body and "<script" not in body,
          "HTTPS with an admin certificate of the cluster CA (Python): the page")
    for what, cert_dir in (("no client certificate", None), ("another CA's certificate", tls.foreign)):
        try:
            status, _ = get(cert_dir)
            check(False, f"Python, {what}: refused (got HTTP {status})")
        except (OSError, ssl.SSLError) as e:
            check(True, f"Python, {what}: refused ({type(e).__name__}: {str(e)[:120]})")
    # Plain HTTP to the HTTPS port: no page, but a plain-text 400 saying to use https:// and a client certificate
    # (before, the connection closed without a word).
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{page_port}/", timeout=10) as r:
            check(False, f"plain HTTP to the TLS page: refused (got HTTP {r.status})")
    except urllib.error.HTTPError as e:
        body = e.read().decode()
        check(e.code == 400 and "https://" in body and "client certificate" in body and "<" not in body,
              f"plain HTTP to the TLS page: 400 saying to use https:// with a client certificate ({body.strip()!r})")
    except OSError as e:
        check(False, f"plain HTTP to the TLS page: a 400 naming https:// (got {type(e).__name__}: {e})")
    # The handshake passes (the cluster CA signed it), the role check answers 403 naming the CN.
    try:
        status, _ = get(tls.certs, tls.not_a_role())
        check(False, f"a cluster-CA certificate whose CN is no wsync role: 403 (got HTTP {status})")
    except urllib.error.HTTPError as e:
        body = e.read().decode()
        check(e.code == 403 and 'CN "operator:ui": not a wsync identity' in body,
              f"a cluster-CA certificate whose CN is no wsync role: 403 ({e.code}: {body.strip()[:120]})")
    check(procs.alive("coordinator"), "the coordinator serves on after the refusals")
    status, _ = get(tls.certs)
    check(status == 200, "and still serves a valid client")
    rotation_checks(check, tls, page_port, wd)


def served_certificate(port: int, ctx: ssl.SSLContext) -> bytes:
    """The DER certificate the page's server presents in a handshake."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as raw:
        with ctx.wrap_socket(raw, server_hostname="127.0.0.1") as conn:
            return conn.getpeercert(binary_form=True)


def rotation_checks(check, tls: Tls, page_port: int, wd: str) -> None:
    """The page takes the coordinator's rotated files (checked every second here, --tls-refresh-seconds 1) without a
    restart: a new server certificate of the same CA, and a CA bundle that adds another CA, whose client
    certificates it then accepts."""
    fresh = os.path.join(wd, "rotated")
    os.makedirs(fresh)
    for f in ("ca.pem", "ca-key.pem"):
        shutil.copy(os.path.join(tls.certs, f), fresh)
    subprocess.run([os.path.join(ROOT, "tools", "cli", "wsync-certs.sh"), fresh, "coordinator:ui"], check=True,
                   stdout=subprocess.DEVNULL)
    new_der = ssl.PEM_cert_to_DER_cert(open(f"{fresh}/coordinator-ui.pem").read())
    before = served_certificate(page_port, tls.context(tls.certs))
    check(before != new_der, "before the rotation the page presents the first certificate")
    with open(f"{fresh}/ca-bundle.pem", "w") as out:
        out.write(open(f"{tls.certs}/ca.pem").read() + open(f"{tls.foreign}/ca.pem").read())
    for src, dst in (("coordinator-ui-key.pem", "coordinator-ui-key.pem"), ("coordinator-ui.pem", "coordinator-ui.pem"),
                     ("ca-bundle.pem", "ca.pem")):
        os.replace(os.path.join(fresh, src), os.path.join(tls.certs, dst))

    def rotated():
        ctx = tls.context(tls.foreign)  # trusts the bundle now in certs/ca.pem, presents the other CA's admin
        if served_certificate(page_port, ctx) != new_der:
            return None
        with urllib.request.urlopen(f"https://127.0.0.1:{page_port}/", timeout=10, context=ctx) as r:
            return r.status == 200 and "wsync coordinator" in r.read().decode()
    try:
        ok, err = harness.wait_for("the page on the rotated files", rotated, 20, None, None, 0.2), ""
    except TimeoutError as e:
        ok, err = False, f": {e}"
    check(ok, "after the rotation, without a restart: the page presents the new certificate, and a client of the "
              "CA the bundle added gets the page" + err)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--keep", action="store_true", help="keep the work directory (screenshot, plots, logs)")
    args = ap.parse_args()
    chrome = ensure("chromium", "chromium")
    ensure("rsvg-convert", "librsvg2-bin")
    ensure("certutil", "libnss3-tools")  # also brings pk12util
    check = harness.Checks()
    with harness.workdir("wsync-status-page-", keep=args.keep) as wd:
        b, model = os.path.abspath(args.bin), os.path.abspath(args.model)
        cluster_checks(check, b, model, wd, chrome, None)
        cluster_checks(check, b, model, wd, chrome, Tls(wd))
    return check.verdict()


if __name__ == "__main__":
    sys.exit(main())

"""A real OpenSSH server on loopback, started and stopped by the test suite, for the SSH transport's tests.

`running_sshd` generates a throwaway host key and client key (ed25519) in a temporary directory, writes an
``sshd_config`` (127.0.0.1 on a free port, that host key, the client key as the only authorized key, no
password, no keyboard-interactive, no PAM, ``StrictModes no``, and git told to read no global or system
configuration in every session) and runs ``sshd -D`` as a child of ours,
logging to a file there. It yields an `SshServer` whose ``config_file`` is a client ``ssh_config``
(``ssh -F``) with two hosts: `HOST_ALIAS`, the listener, and `INETD_HOST_ALIAS`, a ``sshd -i`` that the
ssh client starts for its one connection (``ProxyCommand``); both with our user, the client key, a
``known_hosts`` holding the host key (``StrictHostKeyChecking yes``) and ``BatchMode yes``. On exit it
stops ``sshd``, reaps it and removes the directory.

Why a child and not a daemon: an orphan is re-parented to init, and in some containers init never reaps,
so a daemonized ``sshd`` would stay a zombie for good. A child of ours is reaped by us; but it is also our
descendant, so `subagent.testing.assert_no_leaks` would count it: tests against the listener use
`assert_no_leaks_over_ssh`, which leaves the listener itself out (and nothing else: its sessions, and the
processes they run, are leaks once a test is over); tests that must use `assert_no_leaks` itself (the
contract suite) use `INETD_HOST_ALIAS` with ``running_sshd(listen=False)``.

As root, ``sshd`` insists on its privilege separation directory (``/run/sshd``, which Debian's service
creates at start); `running_sshd` creates it when missing and leaves it (every sshd on the host needs it).
Where no ``sshd`` is installed the tests that need one are skipped, or fail when ``SUBAGENT_REQUIRE_SSH``
is set (CI sets it).
"""

from __future__ import annotations

import contextlib
import os
import pwd
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path

import anyio
import pytest

from subagent.testing import ProcessInfo, assert_same_fds, leak_tag, leaked_processes, open_fds

__all__ = [
    "HOST_ALIAS",
    "INETD_HOST_ALIAS",
    "REQUIRE_SSH_VARIABLE",
    "SshServer",
    "assert_no_leaks_over_ssh",
    "running_sshd",
    "sshd_or_skip",
]

HOST_ALIAS = "subagent-test-sshd"
"""The host name the client config gives the loopback server."""
INETD_HOST_ALIAS = "subagent-test-sshd-inetd"
"""A host name the client config reaches through a ``sshd -i`` of its own (``ProxyCommand``): the server,
a child of the ssh client, serves that one connection, so everything of the run, "remote" side
included, is a descendant of ours until the run is over (what `assert_no_leaks` wants)."""
_HOST_KEY_ALIAS = "subagent-test-sshd-key"
REQUIRE_SSH_VARIABLE = "SUBAGENT_REQUIRE_SSH"
"""Set (CI sets it): a missing ``sshd`` or ``ssh`` fails the SSH tests instead of skipping them."""
START_TIMEOUT = 20.0
"""A hang guard on ``sshd`` starting to listen (it takes milliseconds)."""
STOP_TIMEOUT = 10.0
"""A hang guard on ``sshd`` exiting after SIGTERM."""
LEAK_SETTLE_TIMEOUT = 20.0
"""How long `assert_no_leaks_over_ssh` waits for the remote side of finished runs to be gone. The far end
of a closed connection ends on its own (sshd's session, then the supervisor's sweep: at most about
1.5 s after it notices), so this is a hang guard, never a statement about speed."""
_PRIVSEP_DIR = Path("/run/sshd")
_SBIN = ("/usr/sbin", "/sbin", "/usr/local/sbin")


@dataclass(frozen=True, slots=True)
class SshServer:
    """A running loopback ``sshd`` and what a client needs to log in to it."""

    host: str
    """The host alias `config_file` defines for the listener."""
    inetd_host: str
    """The host alias `config_file` defines for a ``sshd -i`` per connection (see `INETD_HOST_ALIAS`)."""
    config_file: Path
    """A client ``ssh_config`` (``ssh -F``) for `host` and `inetd_host`: port or proxy command, user, key,
    known host key, BatchMode."""
    port: int
    user: str
    directory: Path
    """The temporary directory holding keys, configs, pid file and log."""
    log_file: Path
    pid: int | None
    """The listener's pid (a child of this process), or None if `running_sshd` was asked not to listen."""

    def log(self) -> str:
        """What ``sshd`` has logged so far."""
        return self.log_file.read_text(errors="replace") if self.log_file.exists() else ""


def find_program(name: str) -> str | None:
    """``name`` on PATH or in the sbin directories (a normal user's PATH often lacks them)."""
    return shutil.which(name, path=os.pathsep.join([os.environ.get("PATH", ""), *_SBIN]))


def sshd_or_skip() -> tuple[str, str]:
    """The absolute paths of ``sshd`` and ``ssh``, or skip (fail under `REQUIRE_SSH_VARIABLE`)."""
    sshd, ssh, keygen = find_program("sshd"), find_program("ssh"), find_program("ssh-keygen")
    if sshd is None or ssh is None or keygen is None:
        reason = "OpenSSH (sshd, ssh, ssh-keygen) is not installed: apt-get install openssh-server"
        if os.environ.get(REQUIRE_SSH_VARIABLE):
            pytest.fail(reason)
        pytest.skip(reason)
    return sshd, ssh


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


def _keygen(path: Path) -> None:
    keygen = find_program("ssh-keygen")
    assert keygen is not None  # sshd_or_skip checked it.
    subprocess.run(
        [keygen, "-q", "-t", "ed25519", "-N", "", "-C", "", "-f", str(path)],
        check=True,
        capture_output=True,
        timeout=START_TIMEOUT,
    )


def _write_configs(sshd: str, directory: Path, port: int, user: str) -> tuple[Path, Path]:
    """The server's sshd_config and the client's ssh_config in ``directory``; the keys are there already."""
    server_config = directory / "sshd_config"
    server_config.write_text(
        f"ListenAddress 127.0.0.1\n"
        f"Port {port}\n"
        f"HostKey {directory / 'host_key'}\n"
        f"AuthorizedKeysFile {directory / 'authorized_keys'}\n"
        f"PidFile {directory / 'sshd.pid'}\n"
        "PasswordAuthentication no\n"
        "KbdInteractiveAuthentication no\n"
        "PubkeyAuthentication yes\n"
        "UsePAM no\n"
        "StrictModes no\n"
        "PermitRootLogin prohibit-password\n"
        f"AllowUsers {user}\n"
        "PrintMotd no\n"
        "X11Forwarding no\n"
        "AllowAgentForwarding no\n"
        "LogLevel INFO\n"
        # Every test connection is a start-up: do not let sshd refuse a burst of them.
        "MaxStartups 100\n"
        # git run "remotely" (the workspace core over ssh) reads no configuration of the machine's.
        "SetEnv GIT_CONFIG_GLOBAL=/dev/null GIT_CONFIG_NOSYSTEM=1\n"
    )
    host_key = (directory / "host_key.pub").read_text().split()
    (directory / "known_hosts").write_text(f"{_HOST_KEY_ALIAS} {host_key[0]} {host_key[1]}\n")
    client_config = directory / "ssh_config"
    client_config.write_text(
        f"Host {HOST_ALIAS}\n"
        "  HostName 127.0.0.1\n"
        f"  Port {port}\n"
        f"Host {INETD_HOST_ALIAS}\n"
        f"  ProxyCommand {sshd} -i -f {server_config} -E {directory / 'sshd.log'}\n"
        "Host *\n"
        f"  HostKeyAlias {_HOST_KEY_ALIAS}\n"
        f"  User {user}\n"
        f"  IdentityFile {directory / 'client_key'}\n"
        "  IdentitiesOnly yes\n"
        f"  UserKnownHostsFile {directory / 'known_hosts'}\n"
        "  GlobalKnownHostsFile /dev/null\n"
        "  StrictHostKeyChecking yes\n"
        "  BatchMode yes\n"
    )
    return server_config, client_config


def _wait_listening(process: subprocess.Popen[bytes], pid_file: Path, log_file: Path) -> None:
    """Return once ``sshd`` listens (it writes its pid file right after binding); raise if it exits."""
    deadline = time.monotonic() + START_TIMEOUT
    while time.monotonic() < deadline:
        if process.poll() is not None:
            log = log_file.read_text(errors="replace") if log_file.exists() else ""
            raise RuntimeError(f"sshd exited with status {process.returncode}: {log.strip()}")
        with contextlib.suppress(FileNotFoundError, ValueError):
            if int(pid_file.read_text()) == process.pid:
                return
        time.sleep(0.005)  # A poll interval: the wait itself is bounded by the deadline.
    raise RuntimeError(f"sshd did not listen within {START_TIMEOUT:g}s")


def _stop(process: subprocess.Popen[bytes]) -> None:
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=STOP_TIMEOUT)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=STOP_TIMEOUT)


@contextlib.contextmanager
def running_sshd(*, listen: bool = True) -> Iterator[SshServer]:
    """Run a throwaway ``sshd`` on 127.0.0.1 for our own user; stop it and remove its files on exit.

    ``listen=False``: start no listener; only `SshServer.inetd_host` can be reached then.
    Skips (or fails, under `REQUIRE_SSH_VARIABLE`) where OpenSSH is not installed.
    """
    sshd, _ = sshd_or_skip()
    user = pwd.getpwuid(os.getuid()).pw_name
    if os.geteuid() == 0:
        # sshd as root needs its privilege-separation directory for every connection. It is OpenSSH's own
        # runtime directory (made at boot where the package's service runs), so it stays: removing it would
        # break every other sshd on this host, a second test session's included (seen: its connections
        # were reset during key exchange).
        _PRIVSEP_DIR.mkdir(mode=0o755, exist_ok=True)
    directory = Path(tempfile.mkdtemp(prefix="subagent-sshd-"))
    process: subprocess.Popen[bytes] | None = None
    try:
        _keygen(directory / "host_key")
        _keygen(directory / "client_key")
        shutil.copyfile(directory / "client_key.pub", directory / "authorized_keys")
        log_file = directory / "sshd.log"
        # A port picked free can be taken before sshd binds it: then sshd exits, and another is tried.
        for attempt in range(3):
            port = _free_port()
            server_config, client_config = _write_configs(sshd, directory, port, user)
            if not listen:
                break
            process = subprocess.Popen(
                # sshd re-executes itself, so it must be named by its absolute path.
                [sshd, "-D", "-f", str(server_config), "-E", str(log_file)],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                start_new_session=True,
            )
            try:
                _wait_listening(process, directory / "sshd.pid", log_file)
                break
            except RuntimeError:
                _stop(process)
                process = None
                if attempt == 2:
                    raise
        assert process is not None or not listen
        yield SshServer(
            host=HOST_ALIAS,
            inetd_host=INETD_HOST_ALIAS,
            config_file=client_config,
            port=port,
            user=user,
            directory=directory,
            log_file=log_file,
            pid=None if process is None else process.pid,
        )
    finally:
        if process is not None:
            _stop(process)
        shutil.rmtree(directory, ignore_errors=True)


def _leaked_except(server: SshServer, tag: str) -> list[ProcessInfo]:
    return [info for info in leaked_processes(tag) if info.pid != server.pid]


@contextlib.asynccontextmanager
async def assert_no_leaks_over_ssh(server: SshServer) -> AsyncIterator[str]:
    """`assert_no_leaks` for runs over ssh to ``server``; yields the leak tag.

    Pass ``{LEAK_TAG_VARIABLE: tag}`` in the remote agent's environment: the transport does not forward
    ours, and the tag is what finds a remote process that was orphaned. On exit it waits (bounded by
    `LEAK_SETTLE_TIMEOUT`) until no process is left but the listener (its sessions, the remote supervisors
    and agents end on their own once the connection is closed), then checks that this process has as many
    open file descriptors as on entry.
    """
    with leak_tag() as tag:
        fds_before = open_fds()
        yield tag
    with anyio.move_on_after(LEAK_SETTLE_TIMEOUT):
        while True:
            if not _leaked_except(server, tag):
                break
            await anyio.sleep(0.02)  # A poll interval; the wait is bounded above.
    leaked = _leaked_except(server, tag)
    assert not leaked, f"processes left behind: {leaked}"
    assert_same_fds(fds_before)

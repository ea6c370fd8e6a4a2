"""The supervisor between our process and one child agent: no descendant of the agent outlives it (Linux).

Usage: ``python -I -S _supervisor.py --status-fd FD --parent-pid PID -- ARGV...``; the local transport
(``_local``) imports it by the same arguments from its directory (``-c "...from _supervisor import
main..."``), so its bytecode is cached. It imports only the standard library, never the ``subagent``
package, so it starts in about 10 ms and stays small (9 MiB resident, 4 MiB proportional). It inherits
the agent's stdin/stdout/stderr pipes, environment and working directory, and leads its own session.

What it does
    It makes itself a *child subreaper* (``PR_SET_CHILD_SUBREAPER``), so every orphaned descendant of the
    agent, double-forked or ``setsid``'d daemons included, is re-parented to it rather than to init. It
    forks and execs ARGV in a new process group (so the agent's pid is its process group id), with exactly
    the environment our parent asked for (read from ``/proc/self/environ``: Python may have added
    ``LC_CTYPE`` to its own, PEP 538), the signal mask it inherited and the dispositions Python changed
    (SIGPIPE, SIGXFSZ) back at their defaults: what a direct spawn with `subprocess` gives. Then it points
    its own fds 0/1/2 at ``/dev/null``, so that the agent's pipes reach end of file when the agent and its
    descendants close them, never because of us.

Status pipe (FD; one line per message, ASCII)
    ``pid <agent pid>`` once the agent runs; or, and then the supervisor exits 127, ``error <errno> <text>``
    if exec failed, ``fail <text>`` if the supervisor itself could not do its job. ``exit <returncode>`` as
    soon as the agent itself is reaped (negative: killed by that signal, as in `subprocess`). Nothing
    follows ``exit`` but, when relaying stdout, ``stdout <count>`` (it may come before or after ``exit``).

Relaying stdout (``relay_stdout``; the SSH transport's remote supervisor, never a local one)
    The agent's stdout is then a pipe of ours, whose content a thread copies to our own stdout as it
    comes (``splice``: the kernel moves the pages; no copy through this process). When every holder of
    the pipe's write end has closed it (the agent, and any descendant that inherited it), the thread
    reports ``stdout <bytes relayed>`` on the status pipe and closes our stdout. A reader that cannot
    see the agent's stdout end on its own (ssh's client keeps its stdout open until the remote command
    exits) learns it so, and where in the stream. If our stdout breaks (its reader is gone), the thread
    closes the pipe, so the agent's next write fails as it would have written there directly. The
    supervisor exits only once everything was relayed (or its parent is gone).

Requests (signals)
    * SIGTERM (also SIGINT, SIGHUP): SIGTERM to every live descendant once: the agent's process group with
      ``killpg`` while the agent is unreaped (the group id cannot have been reused then), and each
      descendant outside that group by pid.
    * SIGUSR1: SIGKILL every descendant, again and again until none is left, reap them all, exit.
    * Our parent dies (``getppid()`` changes, or the status pipe breaks; checked every `IDLE_POLL` s):
      SIGTERM to every descendant, `PARENT_DEATH_GRACE` s for them to go, then as SIGUSR1.
      ``PR_SET_PDEATHSIG`` cannot serve here: it fires when the *thread* that spawned us exits, and trio
      spawns from worker threads it retires.

It exits (status 0) once it has no child left, which, as their subreaper, means no descendant left.
Descendants are found by walking ``/proc`` from our pid, and each is signalled through a pidfd after
checking its start time, so a pid reused by an unrelated process is never signalled.
"""

from __future__ import annotations

import _thread
import ctypes
import errno
import os
import sys
import time

TYPE_CHECKING = False  # Not typing's: importing typing would cost more start-up time than it is worth here.
if TYPE_CHECKING:
    import signal
else:
    # Every spawn waits for our start, so it is kept short. The public signal module is this C module plus
    # enums, and importing enum is 4 ms of a 15 ms start (measured); signals are plain ints here.
    try:
        import _signal as signal
    except ImportError:  # Not CPython.
        import signal

IDLE_POLL = 0.25
"""How often an idle supervisor checks that its parent is alive: the bound on noticing the parent's death."""
BUSY_POLL = 0.02
"""While waiting for descendants to die, how often to look again."""
PARENT_DEATH_GRACE = 1.0
"""After our parent dies, how long descendants get to act on SIGTERM before SIGKILL."""
KILL_BOUND = 10.0
"""A process in uninterruptible sleep can ignore even SIGKILL for a while; give up on it after this long."""
RELAY_CHUNK = 64 * 1024
"""The most one relay step moves: a pipe's default capacity."""

_PR_SET_CHILD_SUBREAPER = 36
_STOP_REQUESTS = frozenset({signal.SIGTERM, signal.SIGINT, signal.SIGHUP})
_WATCHED = frozenset({signal.SIGCHLD, signal.SIGUSR1, *_STOP_REQUESTS})
_RESET_FOR_AGENT = frozenset({signal.SIGPIPE, signal.SIGXFSZ})
"""Python ignores these at start-up; an ignored disposition survives exec, so the agent must get them
reset."""


class _ProcessEntry:
    __slots__ = ("pgrp", "pid", "ppid", "starttime", "zombie")

    def __init__(self, pid: int, zombie: bool, ppid: int, pgrp: int, starttime: int) -> None:
        self.pid = pid
        self.zombie = zombie
        self.ppid = ppid
        self.pgrp = pgrp
        self.starttime = starttime


def _read_stat(pid: int) -> _ProcessEntry | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat_file:
            stat = stat_file.read()
    except OSError:
        return None  # Gone while we looked.
    # "pid (comm) state ppid pgrp ... starttime(22nd field)": comm may hold spaces or ")".
    fields = stat[stat.rfind(b")") + 2 :].split()
    return _ProcessEntry(pid, fields[0] in (b"Z", b"X"), int(fields[1]), int(fields[2]), int(fields[19]))


def _descendants() -> list[_ProcessEntry]:
    """Our live descendants, found by walking the parent links in /proc from our own pid."""
    children: dict[int, list[_ProcessEntry]] = {}
    with os.scandir("/proc") as entries:
        for entry in entries:
            if entry.name.isdigit() and (info := _read_stat(int(entry.name))) is not None:
                children.setdefault(info.ppid, []).append(info)
    found: list[_ProcessEntry] = []
    pending = list(children.get(os.getpid(), ()))
    while pending:
        info = pending.pop()
        if not info.zombie:
            found.append(info)
        pending.extend(children.get(info.pid, ()))
    return found


def _signal_process(info: _ProcessEntry, sig: int) -> None:
    """Signal ``info.pid`` only if it is still the process we found (same start time), never a reused pid."""
    try:
        pidfd = os.pidfd_open(info.pid)
    except ProcessLookupError:
        return
    except OSError:
        pidfd = -1  # No pidfd (kernel older than 5.3): a plain kill after the same check.
    try:
        current = _read_stat(info.pid)
        if current is None or current.starttime != info.starttime:
            return
        if pidfd >= 0:
            signal.pidfd_send_signal(pidfd, sig)
        else:
            os.kill(info.pid, sig)
    except ProcessLookupError:
        pass
    finally:
        if pidfd >= 0:
            os.close(pidfd)


class Supervisor:
    """One agent and its descendants; `run` returns the supervisor's exit status."""

    def __init__(
        self, command: list[bytes], status_fd: int, parent_pid: int, *, relay_stdout: bool = False
    ) -> None:
        self.command = command
        self.status_fd = status_fd
        self.parent_pid = parent_pid
        self.relay_stdout = relay_stdout
        self.agent_pid = 0
        self.agent_reaped = False
        self.parent_gone = False
        self.relay_done = _thread.allocate_lock()
        """Held while the relay thread runs (see the module docstring)."""
        self.report_lock = _thread.allocate_lock()

    def report(self, line: str) -> None:
        # Locked: the relay thread reports too, and must never write to a closed (or reused) fd.
        with self.report_lock:
            if self.status_fd < 0:
                return
            try:
                os.write(self.status_fd, line.encode() + b"\n")
            except OSError:
                # EPIPE: nobody reads the status any more, so our parent is gone.
                os.close(self.status_fd)
                self.status_fd = -1
                self.parent_gone = True

    def parent_alive(self) -> bool:
        if os.getppid() != self.parent_pid:
            self.parent_gone = True
        return not self.parent_gone

    def spawn(self, stdout_fd: int = -1) -> int:
        with open("/proc/self/environ", "rb") as environ_file:
            environ = environ_file.read()
        env: dict[bytes, bytes] = {}
        for item in environ.split(b"\0"):
            name, sep, value = item.partition(b"=")
            if sep:
                env.setdefault(name, value)
        # fork and exec, not posix_spawn: glibc's posix_spawn leaves its internal signals (32, 33) ignored
        # in the new program, and an ignored signal stays ignored across exec.
        errors_read, errors_write = os.pipe()  # Close-on-exec: end of file means exec succeeded.
        pid = os.fork()
        if pid == 0:
            try:
                os.setpgid(0, 0)
                if stdout_fd >= 0:
                    os.dup2(stdout_fd, 1)  # The copy is inheritable; the pipe's own fds close on exec.
                for sig in _RESET_FOR_AGENT:
                    signal.signal(sig, signal.SIG_DFL)
                # Nothing blocked, whatever our starter's thread blocked (a Ray worker's event-loop thread
                # blocks SIGINT): a blocked signal stays blocked across exec, and teardown relies on them.
                signal.pthread_sigmask(signal.SIG_SETMASK, ())
                os.execvpe(self.command[0], self.command, env)
            except (OSError, ValueError) as exc:
                code = exc.errno if isinstance(exc, OSError) and exc.errno else 0
                reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
                os.write(errors_write, f"{code} {reason}".encode())
            finally:
                os._exit(127)
        os.close(errors_write)
        # Blocks until exec succeeded or failed: the pid reported is then the agent's, in its own group.
        with os.fdopen(errors_read, "rb") as errors:
            failure = errors.read()
        if failure:
            os.waitpid(pid, 0)
            errno_text, _, strerror = failure.decode(errors="replace").partition(" ")
            raise OSError(int(errno_text), strerror)
        return pid

    def relay(self, source: int, sink: int) -> None:
        """The relay thread: ``source`` (the agent's stdout pipe) to ``sink`` (our stdout) until the
        pipe's end, then report the byte count; see the module docstring."""
        relayed = 0
        splice = getattr(os, "splice", None)  # Python 3.10 or later.
        try:
            os.set_blocking(sink, True)  # Ours alone now (our fd 1 is /dev/null), whoever made it.
            while True:
                try:
                    if splice is not None:
                        try:
                            moved = splice(source, sink, RELAY_CHUNK)
                        except OSError as exc:
                            if exc.errno != errno.EINVAL:
                                raise
                            splice = None  # A sink splice cannot write to: nothing was moved.
                            continue
                    else:
                        data = os.read(source, RELAY_CHUNK)
                        moved = len(data)
                        view = memoryview(data)
                        while view:
                            view = view[os.write(sink, view) :]
                except OSError:
                    return  # Our stdout broke: its reader is gone. Closing the pipe tells the agent.
                if moved == 0:
                    self.report(f"stdout {relayed}")
                    return
                relayed += moved
        finally:
            os.close(source)
            os.close(sink)
            self.relay_done.release()

    def wait_relayed(self) -> None:
        """Wait until the relay thread is done (no writer is left: our children are all gone), or until
        our parent is gone, when nobody is left to relay to."""
        while not self.relay_done.acquire(timeout=IDLE_POLL):
            if not self.parent_alive():
                return
        self.relay_done.release()

    def reap(self) -> bool:
        """Reap every child that exited, reporting the agent's status; True while any child remains."""
        while True:
            try:
                pid, wait_status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return False
            if pid == 0:
                return True
            if pid == self.agent_pid:
                self.agent_reaped = True
                self.report(f"exit {os.waitstatus_to_exitcode(wait_status)}")

    def signal_all(self, sig: int) -> int:
        """Send ``sig`` to every live descendant once; how many there were."""
        found = _descendants()
        skip_group = False
        if not self.agent_reaped:
            # The agent (even as a zombie) holds its group id, so the group cannot be someone else's.
            try:
                os.killpg(self.agent_pid, sig)
                skip_group = True
            except OSError:
                pass
        for info in found:
            if not (skip_group and info.pgrp == self.agent_pid):
                _signal_process(info, sig)
        return len(found)

    def wait_signal(self, timeout: float) -> int | None:
        info = signal.sigtimedwait(_WATCHED, timeout)
        return None if info is None else info.si_signo

    def kill_all(self) -> None:
        """SIGKILL every descendant until none is left (one may fork meanwhile), then reap them all."""
        deadline = time.monotonic() + KILL_BOUND
        while time.monotonic() < deadline:
            children_left = self.reap()
            if self.signal_all(signal.SIGKILL) == 0 and not children_left:
                return
            self.wait_signal(BUSY_POLL)
        self.reap()

    def terminate_after_parent_death(self) -> None:
        self.signal_all(signal.SIGTERM)
        deadline = time.monotonic() + PARENT_DEATH_GRACE
        while time.monotonic() < deadline:
            if not self.reap():
                return
            self.wait_signal(BUSY_POLL)
        self.kill_all()

    def run(self) -> int:
        # Blocked signals stay pending until sigtimedwait() takes them: none is lost, no handler races.
        signal.pthread_sigmask(signal.SIG_BLOCK, _WATCHED)
        # An ignored SIGCHLD (inherited) would make the kernel reap children for us, status and all.
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        os.set_inheritable(self.status_fd, False)
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
            self.report(f"fail cannot become a child subreaper: {os.strerror(ctypes.get_errno())}")
            return 127
        if not self.parent_alive():
            return 1  # Our parent died before we could start anything: start nothing.
        stdout_read = stdout_write = -1
        if self.relay_stdout:
            stdout_read, stdout_write = os.pipe()
        try:
            self.agent_pid = self.spawn(stdout_write)
        except OSError as exc:
            code = exc.errno or 0
            self.report(f"error {code} {exc.strerror or exc}")
            return 127
        except ValueError as exc:  # Refused by the parent already; kept as a last line of defence.
            self.report(f"fail {exc}")
            return 127
        if self.relay_stdout:
            os.close(stdout_write)
            self.relay_done.acquire()
            # Started after the fork, so the child never saw a thread; it inherits our blocked signals.
            _thread.start_new_thread(self.relay, (stdout_read, os.dup(1)))
        devnull = os.open(os.devnull, os.O_RDWR)
        for fd in (0, 1, 2):
            os.dup2(devnull, fd)
        os.close(devnull)
        self.report(f"pid {self.agent_pid}")
        while self.reap():
            if not self.parent_alive():
                self.terminate_after_parent_death()
                return 0
            request = self.wait_signal(IDLE_POLL)
            if request in _STOP_REQUESTS:
                self.signal_all(signal.SIGTERM)
            elif request == signal.SIGUSR1:
                self.kill_all()
                return 0
        if self.relay_stdout:
            self.wait_relayed()
        return 0


def main(argv: list[str]) -> int:
    """Parse ``--status-fd FD --parent-pid PID -- ARGV...`` and supervise ARGV."""
    try:
        separator = argv.index("--")
        options = dict(zip(argv[0:separator:2], argv[1:separator:2], strict=True))
        status_fd = int(options.pop("--status-fd"))
        parent_pid = int(options.pop("--parent-pid"))
        command = [os.fsencode(arg) for arg in argv[separator + 1 :]]
        if options or not command:
            raise ValueError(argv)
    except (ValueError, KeyError):
        sys.stderr.write("usage: _supervisor.py --status-fd FD --parent-pid PID -- ARGV...\n")
        return 2
    return Supervisor(command, status_fd, parent_pid).run()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""Drives `strata run --chat` through a pseudo-terminal as a person would:
turns until the small context is full (the oldest turns must be dropped and
the chat go on), a Ctrl-C typed during a reply (the reply ends, the prompt
comes back), one more turn, then Ctrl-D (exit status 0).
    python3 pty_chat.py STRATA MODEL"""
import os
import pty
import select
import sys
import time

strata, model = sys.argv[1], sys.argv[2]
pid, fd = pty.fork()
if pid == 0:
    os.execv(strata, [strata, "run", "-m", model, "--chat", "--device", "cpu", "-t", "2",
                      "-c", "256", "--temp", "0", "--system", "You are a storyteller."])

seen = b""
pending = b""


def fail(msg):
    sys.stderr.write(f"FAIL: {msg}\n--- transcript (end) ---\n{seen[-3000:].decode(errors='replace')}\n")
    try:
        os.kill(pid, 9)
    except OSError:
        pass
    sys.exit(1)


def read_until(pat, timeout):
    """Reads until `pat` appears; returns what came before it and it."""
    global seen, pending
    end = time.time() + timeout
    while pat not in pending:
        left = end - time.time()
        if left <= 0:
            fail(f"no {pat!r} within {timeout} s")
        r, _, _ = select.select([fd], [], [], left)
        if not r:
            continue
        try:
            chunk = os.read(fd, 4096)
        except OSError:
            fail(f"the terminal closed before {pat!r}")
        if not chunk:
            fail(f"the terminal closed before {pat!r}")
        seen += chunk
        pending += chunk
    i = pending.index(pat) + len(pat)
    got, pending = pending[:i], pending[i:]
    return got


def say(text):
    os.write(fd, text.encode() + b"\r")


read_until(b"> ", 180)
turns = 0
while b"context full" not in seen:
    turns += 1
    if turns > 12:
        fail("12 turns and the context never filled")
    say(f"Tell me a long story about dragon number {turns}, with many details.")
    read_until(b"t/s]", 300)
    read_until(b"> ", 60)
# the chat goes on after the shift
say("And one more about a cat.")
read_until(b"t/s]", 300)
read_until(b"> ", 60)
# Ctrl-C during a reply: the reply ends and the prompt returns
say("Write a very long essay about the sea, the ships and the storms.")
read_until(b"storms.", 30)    # the terminal's echo
read_until(b"\n", 30)
# the first words of the reply (not the "[context full ...]" line before
# it: a Ctrl-C before the reply starts is not meant for it), then Ctrl-C
def reply_text():
    return b"".join(l for l in pending.split(b"\n") if not l.startswith(b"[")).strip()


while len(reply_text()) < 8:
    r, _, _ = select.select([fd], [], [], 60)
    if not r:
        fail("no reply")
    chunk = os.read(fd, 4096)
    seen += chunk
    pending += chunk
os.write(fd, b"\x03")
read_until(b"[interrupted]", 60)
read_until(b"> ", 60)
say("Thank you.")
read_until(b"t/s]", 300)
read_until(b"> ", 60)
os.write(fd, b"\x04")
_, status = os.waitpid(pid, 0)
if not os.WIFEXITED(status) or os.WEXITSTATUS(status) != 0:
    fail(f"exit status {status}")
print(f"ok: {turns} turns until the context filled, Ctrl-C and Ctrl-D handled")

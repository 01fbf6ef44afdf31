"""What the gloo groups of a large job need: connections made on first use, and enough file
descriptors for the ones made.

A gloo process group opens a TCP connection to each of its members when it is built, and
the pack builds gloo groups as wide as the world for its host traffic (``comm``'s host
group, the SIGTERM agreement's, zebra's over the attention ranks; on a CPU run the default
group too). ``bench/gloo_groups.py`` (the default group and two more, over the world): rank
0 held 93 descriptors over 16 ranks and 157 over 32, four a peer. Linux's usual soft limit
is 1,024 descriptors: a job of a few hundred ranks would end at set-up in "Too many open
files".

* Gloo connects a pair on its first message instead where ``TORCH_GLOO_LAZY_INIT=1``: the
  strategy sets it unless the environment says otherwise (the host traffic is rings and
  gathers: a rank talks to a few peers). The same bench: 57 descriptors over 16 ranks after
  an all-reduce and an all-gather, 75 over 32, about one a peer.
* A process may raise its own soft limit up to the hard one: the strategy does, to what
  eager connections would need, before its process group starts; where even the hard
  limit is short of that and connections are eager, it says so once, with what to run.
"""

from __future__ import annotations

LAZY = "TORCH_GLOO_LAZY_INIT"
PER_PEER = 4  # descriptors a process holds per peer of the job (measured: see the module's doc)
SPARE = 512  # the process's own: files, loaders' workers, the store, CUDA's


def wanted(world_size: int) -> int:
    """Descriptors a rank of a job of ``world_size`` ranks may hold."""
    return world_size * PER_PEER + SPARE


def raise_open_files(world_size: int, warn: bool = True) -> str | None:
    """Raise this process's soft limit on open files to what :func:`wanted` says, as far as
    the hard limit allows. Returns the warning to print where the hard limit is short and
    ``warn`` (connections made eagerly: lazily made ones need far fewer), else ``None`` (as
    where there is no such limit: not POSIX)."""
    try:
        import resource
    except ImportError:  # Windows: no such limit
        return None
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = wanted(world_size)
    if soft == resource.RLIM_INFINITY or soft >= want:
        return None
    target = want if hard == resource.RLIM_INFINITY else min(want, hard)
    if target > soft:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        except (ValueError, OSError):
            target = soft
    if target >= want or not warn:
        return None
    return (f"HeterMoEStrategy: this process may open {target} files (the hard limit), and a job of {world_size} "
            f"ranks may need about {want} (its gloo groups connect to every peer when built, {LAZY} being off): "
            f"raise the limit where the job starts (`ulimit -n {want}`, or the scheduler's setting for it), or "
            f"the process group may fail with 'Too many open files'")


def connect_lazily(environ: dict | None = None) -> bool:
    """Gloo groups built from now on connect each pair on first use (``TORCH_GLOO_LAZY_INIT=1``),
    unless ``environ`` (``os.environ``) already says; whether they will."""
    import os

    env = os.environ if environ is None else environ
    env.setdefault(LAZY, "1")
    return env[LAZY] == "1"

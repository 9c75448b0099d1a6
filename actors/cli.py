"""The ``dloco`` command: ``dloco train [--config FILE] [--set a.b=c ...] [--address ADDR] [--run-dir DIR]``,
``dloco status RUN_DIR``, ``dloco stop RUN_DIR``, ``dloco plot RUN_DIR [RUN_DIR ...] [--out DIR]``, ``dloco
export RUN_DIR --out DIR [--format safetensors|orbax|hf] [--snapshot N]``, ``dloco eval RUN_DIR_OR_EXPORT
[--data SOURCE]`` and ``dloco prepare SOURCE --out URI [--tokenizer ...]`` (token shards for
``data.source=tokens:URI``, on Ray Data: `actors.prepare`).

With no arguments it trains the `tiny` preset with 4 learners on the built-in `stdlib` corpus on
a local Ray cluster (started and stopped by the command), shows progress, and ends with a table.
Under ``ray job submit`` it joins the job's cluster (RAY_ADDRESS). Bad input (config error,
unreadable file, missing or too small corpus, unusable run directory, changed config on
``--resume``, unreachable cluster, learners no node can hold) ends with one line on stderr,
``dloco: ...``, and exit code 2, found before anything is written (`dloco.preflight`); a run that
ends on an unrecoverable error prints its table, then ``dloco: run failed: ...``, and exits 1.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")


def _preparing(status: dict) -> None:
    """Corpus preparation: one updating line on a terminal; otherwise a line as each stage ends."""
    stage, done, total = status["preparing"], status["done"], status["total"]
    if not sys.stderr.isatty() and done < total:
        return
    line = f"preparing the corpus: {stage} {done:,}/{total:,}" + (" done" if done >= total else "")
    sys.stderr.write(f"\r{line}\033[K" + ("\n" if done >= total else "") if sys.stderr.isatty() else f"{line}\n")
    sys.stderr.flush()


def _progress(cfg):
    """The progress display of `dloco train`: a bar redrawn in place on a terminal, a plain line every
    10 s otherwise (logs, ``ray job submit``); share of the budget, tokens/s, ETA (`dloco.progress`)."""
    from dloco.progress import ProgressLine

    tty = sys.stderr.isatty()
    lines = ProgressLine(cfg.budget, cfg.learners.count, tty=tty)

    def show(status: dict) -> None:
        if "preparing" in status:
            return _preparing(status)
        if (line := lines(status)) is not None:
            sys.stderr.write(f"\r{line}\033[K" if tty else f"{line}\n")
            sys.stderr.flush()

    return show


def _expected() -> tuple[type[BaseException], ...]:
    """The errors a bad input raises while a run is checked and started (the CLI's one-line errors).

    OSError covers a missing or unreadable file (FileNotFoundError, IsADirectoryError,
    NotADirectoryError, PermissionError) and ConnectionError; ConfigError and PreflightError are
    ValueErrors, as are a config file that is not UTF-8 and a corpus that cannot be read.
    """
    from actors.health import ActorStartError
    from dloco.durable import RunDirLocked

    return (OSError, ValueError, RunDirLocked, ActorStartError)


def _locked(e: BaseException) -> str | None:
    """The message of a `RunDirLocked` that the store actor raised as it started, which reaches the
    driver inside a Ray error (an actor whose constructor failed), else None."""
    found = re.search(r"RunDirLocked: (.+)", str(e))
    return found.group(1) if found else None


def _message(e: BaseException) -> str:
    """`e` as the one line the CLI prints: ``dloco: ...``."""
    from dloco.config import ConfigError

    if isinstance(e, ConfigError):
        text = f"config error: {e}"
    elif isinstance(e, OSError) and e.filename and e.strerror:
        text = f"{e.filename}: {e.strerror}"
    else:
        text = _locked(e) or str(e)
    return "dloco: " + (" ".join(text.split()) or type(e).__name__)


def _sections() -> str:
    """The config's sections with the first sentence of each one's docstring, for ``--help``."""
    import dataclasses
    import typing

    from dloco.config import RunConfig

    hints, rows = typing.get_type_hints(RunConfig), []
    for f in dataclasses.fields(RunConfig):
        if dataclasses.is_dataclass(tp := hints[f.name]):
            doc = " ".join((tp.__doc__ or "").split()).split(". ")[0].rstrip(".")
            rows.append(f"  {f.name:<12} {doc if len(doc) <= 84 else doc[: doc.rindex(' ', 0, 83)] + ' ...'}")
    top = [f.name for f in dataclasses.fields(RunConfig) if not dataclasses.is_dataclass(hints[f.name])]
    return (
        "config sections (in a --config YAML file, or --set SECTION.KEY=VALUE; every key: docs/CONFIG.md):\n"
        + "\n".join(rows)
        + f"\n  {'(top level)':<12} {', '.join(top)}"
    )


def train(args: argparse.Namespace) -> int:
    """Checks and starts the run, watches it, prints its table; 2 on bad input, 1 if the run failed."""
    try:
        from dloco.config import load

        cfg = load(args.config, args.set)
        if args.print_config:  # the resolved config, as a --config file that loads to the same run
            import yaml

            print(yaml.safe_dump(cfg.to_dict(), sort_keys=False), end="")
            return 0
        from actors.launch import start, under_job

        handle = start(
            cfg,
            address=args.address,
            run_dir=args.run_dir,
            progress=None if args.quiet else _progress(cfg),
            resume=True if args.resume else None if under_job() else False,  # a resubmitted job continues
        )
    except _expected() as e:
        print(_message(e), file=sys.stderr)
        return 2
    print(f"dloco: run dir {handle.run_dir} ({'continuing its run' if handle.resumed else 'new run'})", file=sys.stderr)
    try:
        handle.wait()
    except KeyboardInterrupt:
        sys.stderr.write("\ninterrupted: stopping the run and writing its summary\n")
    finally:
        summary = handle.stop()
    if not args.quiet:
        sys.stderr.write("\n")
    from dloco.metrics import table

    assert summary is not None, "stop() joins the run's thread, which writes the summary"
    print(table(summary))
    if summary.get("error"):  # the supervisor ends a run on an unrecoverable error and says which
        print(f"dloco: run failed: {' '.join(str(summary['error']).split())}", file=sys.stderr)
        return 1
    return 0


def status_cmd(args: argparse.Namespace) -> int:
    """Prints the state of the run in RUN_DIR (running, ended, not answering); 2 if none is there."""
    from dloco import checkpoints, control
    from dloco.metrics import table

    try:
        s = control.read(args.run_dir)
    except (OSError, ValueError) as e:
        print(_message(e), file=sys.stderr)
        return 2
    newest = checkpoints.newest(args.run_dir)
    saved = f"checkpoint {newest}" if newest is not None else "checkpoint none (export.every_commits / every_s)"
    if s["state"] == "ended":
        print(f"state      ended\n{saved}\n{table(s)}")
        return 0
    loss, errors = s.get("eval_loss"), sum((s.get("errors") or {}).values())
    ago = time.time() - s["updated"]
    print(f"state      {s['state']} (driver pid {s['pid']} on {s['host']}, updated {ago:.0f} s ago)")
    print(f"elapsed    {s['elapsed_s']:.0f} s")
    print(f"tokens     {s['tokens_trained']:,}" + (f" of {s['budget_tokens']:,}" if s.get("budget_tokens") else ""))
    print(f"eval loss  {'--' if loss is None else f'{loss:.3f}'}")
    print(f"merges     {s['merges']} (rejected contributions: {s['rejected']})")
    print(f"learners   {len(s.get('learners') or {})} reporting")
    print(f"errors     {errors}" + (f"; last: {s.get('last_error')}" if errors else ""))
    print(saved)
    return 0


def stop_cmd(args: argparse.Namespace) -> int:
    """Asks the run in RUN_DIR to stop, waits for its summary (up to --wait s) and prints it."""
    from dloco import control
    from dloco.metrics import table

    try:
        control.request_stop(args.run_dir)
    except (OSError, ValueError) as e:
        print(_message(e), file=sys.stderr)
        return 2
    end = time.time() + args.wait
    while time.time() < end:
        if (s := control.read(args.run_dir))["state"] == "ended":
            print(table(s))
            return 0
        time.sleep(0.5)
    print(f"dloco: asked the run to stop; no summary within {args.wait:g} s (see dloco status)", file=sys.stderr)
    return 1


def plot(args: argparse.Namespace) -> int:
    from dloco.plot import plot as plot_runs

    try:
        paths = plot_runs(args.run_dirs, args.out)
    except ValueError as e:  # a malformed metrics.jsonl; a missing one is a FileNotFoundError (main)
        print(f"dloco: {e}", file=sys.stderr)
        return 2
    for path in paths:
        print(path)
    return 0


def export_cmd(args: argparse.Namespace) -> int:
    """Writes a run's global model to --out; 2 on bad input."""
    from dloco import export

    try:
        meta = export.export(args.run_dir, args.out, args.format, args.snapshot)
    except _expected() as e:
        print(_message(e), file=sys.stderr)
        return 2
    print(
        f"wrote {args.out} ({meta['format']}, {meta['parameters']:,} parameters, "
        f"fragment versions {meta['versions']}, from {meta['source']})"
    )
    return 0


def eval_cmd(args: argparse.Namespace) -> int:
    """Validation loss and perplexity of a run's or an export's model on a corpus; 2 on bad input."""
    from dloco import export

    try:
        m = export.load(args.path, args.snapshot)
        r = export.evaluate(m, args.data or m.cfg.data.source, batches=args.batches, batch_size=args.batch_size)
    except _expected() as e:
        print(_message(e), file=sys.stderr)
        return 2
    print(f"model       {r['model']}")
    print(f"data        {r['source']} ({r['documents']:,} documents, {r['tokens']:,} tokens evaluated)")
    print(f"loss        {r['loss']:.4f} nats/token")
    print(f"perplexity  {r['perplexity']:.3f}")
    return 0


def prepare_cmd(args: argparse.Namespace) -> int:
    """Prepares SOURCE into --out as token shards and a manifest (`actors.prepare`); 2 on bad input."""
    from actors.prepare import prepare

    def show(stage: str, done: int, total: int) -> None:
        _preparing({"preparing": stage, "done": done, "total": total})

    names = ("tokenizer", "vocab_size", "tokenizer_sample_bytes", "val_fraction", "text_field", "shard_tokens")
    given = {n: getattr(args, n) for n in names if getattr(args, n) is not None}  # else `dloco.data.prepare`'s
    try:
        m = prepare(args.source, args.out, address=args.address, progress=None if args.quiet else show, **given)
    except _expected() as e:
        print(_message(e), file=sys.stderr)
        return 2
    train, val = m.shards("train"), m.shards("val")
    print(
        f"dloco: {args.out}: {m.tokens('train'):,} training tokens in {len(train)} shards, {m.tokens('val'):,} "
        f"validation tokens in {len(val)}, {m.tokenizer['kind']} tokenizer of {m.tokenizer['vocab_size']} ids; "
        f"train on it with --set data.source=tokens:{args.out}"
    )
    return 0


def main(argv: list[str] | None = None) -> int:
    raw = argparse.RawDescriptionHelpFormatter
    ap = argparse.ArgumentParser(
        prog="dloco", description="Decoupled DiLoCo on Ray.", epilog=_sections(), formatter_class=raw
    )
    sub = ap.add_subparsers(dest="command", required=True)
    t = sub.add_parser(
        "train",
        help="train a model (defaults: tiny preset, 4 learners, stdlib corpus, local Ray)",
        epilog=_sections(),
        formatter_class=raw,
    )
    t.add_argument("--config", help="YAML RunConfig file")
    t.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="dotted override, repeatable")
    t.add_argument("--address", help="Ray cluster address (default: RAY_ADDRESS, else a new local cluster)")
    t.add_argument("--run-dir", help="output directory (default: {run_dir}/{date-time})")
    t.add_argument("--resume", action="store_true", help="continue the run already in --run-dir")
    t.add_argument("--quiet", action="store_true", help="no progress bar")
    t.add_argument("--print-config", action="store_true", help="print the resolved config as YAML and exit")
    st = sub.add_parser("status", help="the state of a run (running or ended) from its run directory")
    st.add_argument("run_dir", metavar="RUN_DIR")
    sp = sub.add_parser("stop", help="stop a running run (as at its budget: final evaluation, summary.json)")
    sp.add_argument("run_dir", metavar="RUN_DIR")
    sp.add_argument("--wait", type=float, default=120.0, help="seconds to wait for its summary (default 120)")
    p = sub.add_parser("plot", help="PNG figures of one or more run directories (metrics.jsonl)")
    p.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="a run directory holding metrics.jsonl")
    p.add_argument("--out", help="output directory (default: RUN_DIR/plots; for several runs, their parent's plots/)")
    x = sub.add_parser(
        "export", help="write a run's global model as safetensors, an Orbax or a Hugging Face checkpoint"
    )
    x.add_argument("run_dir", metavar="RUN_DIR", help="a run directory (running or finished)")
    x.add_argument("--out", required=True, help="a new (or empty) directory for the export")
    x.add_argument(
        "--format",
        default="safetensors",
        help="safetensors (default), orbax or hf (the llama family as HF Llama/Mixtral, with its tokenizer)",
    )
    x.add_argument("--snapshot", type=int, help="the state after this many commits (a kept snapshot); default: newest")
    e = sub.add_parser("eval", help="validation loss and perplexity of a run's or an export's model")
    e.add_argument("path", metavar="RUN_DIR_OR_EXPORT")
    e.add_argument(
        "--data",
        help="corpus source: stdlib | shakespeare | text:GLOB | jsonl:GLOB | parquet:GLOB (default: the run's)",
    )
    e.add_argument("--batches", type=int, default=32, help="batches evaluated (default 32)")
    e.add_argument("--batch-size", type=int, default=16, help="sequences per batch (default 16)")
    e.add_argument("--snapshot", type=int, help="of a run directory: the state after this many commits")
    pr = sub.add_parser("prepare", help="tokenize a corpus on Ray Data into token shards (data.source=tokens:URI)")
    pr.add_argument("source", metavar="SOURCE", help="stdlib | shakespeare | text:GLOB | jsonl:GLOB | parquet:GLOB")
    pr.add_argument(
        "--out", required=True, metavar="URI", help="output directory: a path, file://, s3://, gs://, hdfs://"
    )
    pr.add_argument("--tokenizer", help="byte (default), bpe (trained on a sample) or file:PATH (a tokenizer.json)")
    pr.add_argument("--vocab-size", type=int, help="BPE vocabulary (default 4096)")
    pr.add_argument("--tokenizer-sample-bytes", type=int, help="text a BPE is trained on (default 32,000,000)")
    pr.add_argument("--val-fraction", type=float, help="expected share of validation documents (default 0.05)")
    pr.add_argument("--text-field", help="JSON field or Parquet column of a document's text (default text)")
    pr.add_argument("--shard-tokens", type=int, help="tokens per shard (default 16,777,216)")
    pr.add_argument("--address", help="Ray cluster address (default: RAY_ADDRESS, else a new local cluster)")
    pr.add_argument("--quiet", action="store_true", help="no progress lines")
    args = ap.parse_args(argv)
    from dloco.config import ConfigError

    commands = {
        "plot": plot,
        "train": train,
        "export": export_cmd,
        "eval": eval_cmd,
        "status": status_cmd,
        "stop": stop_cmd,
        "prepare": prepare_cmd,
    }
    try:
        return commands[args.command](args)
    except ConfigError as e:
        print(f"dloco: config error: {e}", file=sys.stderr)
    except (FileNotFoundError, FileExistsError, ConnectionError) as e:
        print(f"dloco: {e}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())

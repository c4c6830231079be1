"""Prepare a dataset for streaming: litdata chunks at a folder or a bucket URL, written once, resumable.

Examples::

    python -m recipes.prepare digits --output s3://my-bucket/digits            # the embedded digits
    python -m recipes.prepare mnist --root data/ --output s3://my-bucket/mnist # MNIST's files under data/MNIST/raw
    python -m recipes.prepare images --root photos/ --output data/stream/photos  # ImageFolder: photos/<class>/*.png
    python -m recipes.prepare text --output s3://my-bucket/stdlib --block_size 128       # the stdlib corpus
    python -m recipes.prepare text --root notes/ --pattern '*.txt' --output gs://b/notes  # a folder of text files

Then train on it: ``python -m recipes.fit --config configs/digits-stream.yaml --data.url s3://my-bucket/digits``.

What it writes (:mod:`datamodules.streaming` reads it): each split's chunks and litdata index under
``<output>/train`` and ``<output>/val`` (``litdata.optimize``), and ``<output>/atscale.json`` (the kind, shapes,
the source's digest, every chunk's SHA-256). The chunks are made in a local staging folder
(``--staging/<source digest>``) and then uploaded: a relaunch after a kill keeps the splits already made and the
files already uploaded, and ``atscale.json`` says ``complete`` only once everything is there.

The source's digest (its content and the settings) names the dataset: the same command again finishes or
confirms it; another dataset at the same URL is refused (exit 2), and so are files that are no prepared dataset.
Credentials come from the environment (the usual AWS and GCP variables), never from the URL: ``--output`` is
checked before anything runs (:func:`datamodules.urls.check_data_url`: a folder, ``file://``, ``s3://`` or ``gs://``,
no credentials, no query string), and every line printed, a traceback included, has its URLs redacted.

Exit status: 0 prepared (or already there); 2 bad input (a missing folder, an unreadable file, an ``--output`` that
is no dataset location, a bucket that does not exist, refuses the credentials or cannot be reached, another dataset
at ``--output``); 1 a failure of the machine.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import hashlib
import json
import os
import shutil
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from datamodules.urls import check_data_url, excepthook, redact
from recipes.run.common import USAGE_EXIT_CODE, ArgumentParser, UsageError, parse_or_exit, run_main

SOURCES = ("digits", "mnist", "images", "text")
#: Bytes per chunk unless ``--chunk_items`` says otherwise: see "Chunk size" in docs/guides/streaming.md.
DEFAULT_CHUNK_BYTES = "16MB"


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(prog="python -m recipes.prepare", description=__doc__.splitlines()[0])
    parser.add_argument("source", choices=SOURCES, help="What to prepare.")
    parser.add_argument("--output", required=True, help="Folder or bucket URL (s3://, gs://) to write to.")
    parser.add_argument("--root", default=None,
                        help="The source's folder (mnist: holds MNIST/raw; images: <class>/<image> folders; "
                             "text: the corpus, default the running Python's standard library).")
    parser.add_argument("--pattern", default="*.py", help="text: file-name pattern of the corpus files.")
    parser.add_argument("--chunk_bytes", default=None,
                        help=f"Bytes per chunk (litdata's chunk_bytes: '512KB', '64MB', or bytes; default "
                             f"{DEFAULT_CHUNK_BYTES}, chosen in docs/guides/streaming.md).")
    parser.add_argument("--chunk_items", type=int, default=None,
                        help="Items per chunk, instead of --chunk_bytes (a chunk of N items whatever their size).")
    parser.add_argument("--val_fraction", type=float, default=0.2,
                        help="images/mnist/digits: share held out for validation (text: 0.1 of the files).")
    parser.add_argument("--split_seed", type=int, default=0, help="Seed of the train/validation split.")
    parser.add_argument("--block_size", type=int, default=128, help="text: the context; items are block_size + 1 "
                                                                    "bytes.")
    parser.add_argument("--val_windows", type=int, default=128, help="text: validation windows (evenly spaced).")
    parser.add_argument("--max_bytes", type=int, default=None, help="text: cap on the corpus's bytes.")
    parser.add_argument("--max_files", type=int, default=None, help="text: cap on the corpus's files.")
    parser.add_argument("--max_items", type=int, default=None,
                        help="images/mnist/digits: keep the first N training items and N/4 validation items (small "
                             "sets for tests and trials).")
    parser.add_argument("--staging", default="data/prepare", help="Local folder where the chunks are made.")
    return parser


# ------------------------------------------------------------------------------------------------- the sources
def _check_positive(args: argparse.Namespace) -> None:
    for flag in ("chunk_items", "max_items", "block_size", "val_windows", "max_bytes", "max_files"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            raise UsageError(f"--{flag} {value}: must be an integer >= 1")
    if args.chunk_items is not None and args.chunk_bytes is not None:
        raise UsageError(f"--chunk_items {args.chunk_items} and --chunk_bytes {args.chunk_bytes}: give one of them")
    if args.chunk_bytes is not None and _bytes(args.chunk_bytes) < 1:
        raise UsageError(f"--chunk_bytes {args.chunk_bytes}: expected a size such as '16MB' or '512KB', or bytes >= 1")
    if not 0.0 < args.val_fraction < 1.0:
        raise UsageError(f"--val_fraction {args.val_fraction}: must lie in (0, 1)")
    if args.root is not None and not Path(args.root).is_dir():
        raise UsageError(f"--root {args.root}: no such folder")
    if args.source in ("mnist", "images") and args.root is None:
        raise UsageError(f"{args.source} needs --root (the folder of the data)")


def _bytes(size: str) -> int:
    """``size`` in bytes (``"16MB"``, ``"512KB"``, ``"1000"``); 0 when it is not a size."""
    from datamodules.verified_chunks import cache_bytes

    try:
        return cache_bytes(int(size) if str(size).strip().isdigit() else size)
    except ValueError:
        return 0


def chunking(args: argparse.Namespace) -> dict[str, int]:
    """How the chunks are cut: ``{"chunk_items": n}`` or ``{"chunk_bytes": bytes}`` (the default's)."""
    if args.chunk_items is not None:
        return {"chunk_items": args.chunk_items}
    return {"chunk_bytes": _bytes(args.chunk_bytes or DEFAULT_CHUNK_BYTES)}


def _image_arrays(args: argparse.Namespace) -> tuple[dict[str, Any], list[tuple[Any, Any]], str]:
    """``(meta, [(x, y) of train, (x, y) of val], digest)`` of an image source, scaled as in memory."""
    import numpy as np

    if args.source == "digits":
        from datamodules.digits import DigitsDataModule

        dm = DigitsDataModule(val_fraction=args.val_fraction, split_seed=args.split_seed)
        x_tr, y_tr, x_va, y_va = dm._arrays()
        meta = {"num_classes": 10, "in_channels": 1, "image_size": 8}
        return meta, [(x_tr[:, None], y_tr), (x_va[:, None], y_va)], dm.fingerprint()
    if args.source == "mnist":
        from datamodules.vision import MNISTDataModule

        try:
            dm = MNISTDataModule(root=args.root, download=False, val_fraction=args.val_fraction,
                                 split_seed=args.split_seed)
            x_tr, y_tr, x_va, y_va = dm._arrays()
        except (FileNotFoundError, RuntimeError) as err:
            raise UsageError(f"--root {args.root}: {' '.join(str(err).split())}") from None
        meta = {"num_classes": 10, "in_channels": 1, "image_size": 28}
        return meta, [(dm._scale(x_tr), y_tr), (dm._scale(x_va), y_va)], dm.fingerprint()
    from PIL import Image, UnidentifiedImageError
    from sklearn.model_selection import train_test_split
    from torchvision.datasets import ImageFolder

    try:
        folder = ImageFolder(args.root)
    except (FileNotFoundError, OSError) as err:
        raise UsageError(f"--root {args.root}: {' '.join(str(err).split())}") from None
    images, digest = [], hashlib.sha256()
    for path, label in folder.samples:
        try:
            with Image.open(path) as image:
                array = np.asarray(image.convert("RGB" if image.mode not in ("L", "1") else "L"))
        except (OSError, UnidentifiedImageError) as err:
            raise UsageError(f"--root {args.root}: {path} is not a readable image ({err})") from None
        array = array[None] if array.ndim == 2 else array.transpose(2, 0, 1)
        if images and array.shape != images[0].shape:
            raise UsageError(f"--root {args.root}: {path} is {tuple(array.shape)}, the first image "
                             f"{tuple(images[0].shape)}; resize the images to one size first")
        images.append(array)
        digest.update(f"{os.path.relpath(path, args.root)}\0{label}\0".encode() + array.tobytes())
    if len(images) < 2:
        raise UsageError(f"--root {args.root}: fewer than 2 images in an ImageFolder layout (<class>/<image>)")
    x = (np.stack(images).astype(np.float32) / 255.0)
    y = np.asarray([label for _, label in folder.samples], dtype=np.int64)
    tr, va = train_test_split(np.arange(len(y)), test_size=args.val_fraction, random_state=args.split_seed,
                              stratify=y if min(np.bincount(y)) >= 2 else None)
    tr.sort()
    va.sort()
    meta = {"num_classes": len(folder.classes), "classes": folder.classes, "in_channels": int(x.shape[1]),
            "image_size": int(x.shape[2])}
    return meta, [(x[tr], y[tr]), (x[va], y[va])], digest.hexdigest()


def _image_item(index: int, x: Any, y: Any) -> dict[str, Any]:
    return {"x": x[index], "y": int(y[index])}


def _token_item(index: int, data: Any, starts: Any, length: int) -> dict[str, Any]:
    start = int(starts[index])
    return {"x": data[start:start + length].copy()}


def describe(args: argparse.Namespace) -> tuple[dict[str, Any], dict[str, tuple[Callable[[int], Any], int]]]:
    """``(meta, {split: (item function, count)})`` of the source; ``meta["source_digest"]`` names the dataset."""
    import numpy as np

    settings = {"source": args.source, "split_seed": args.split_seed, **chunking(args)}
    if args.source != "text":
        meta, splits, content = _image_arrays(args)
        if args.max_items is not None:
            caps = (args.max_items, max(1, args.max_items // 4))
            splits = [(x[:cap], y[:cap]) for (x, y), cap in zip(splits, caps, strict=True)]
        settings.update(val_fraction=args.val_fraction, max_items=args.max_items)
        meta["kind"] = "images"
        fns = {name: (functools.partial(_image_item, x=x, y=y), len(y)) for name, (x, y) in zip(("train", "val"),
                                                                                                splits, strict=True)}
    else:
        from datamodules.text import TextDataModule, even_starts

        try:
            dm = TextDataModule(root=args.root, pattern=args.pattern, block_size=args.block_size,
                                val_windows=args.val_windows, split_seed=args.split_seed, max_files=args.max_files,
                                max_bytes=args.max_bytes, cache_dir=str(Path(args.staging) / "text-cache"))
            dm.setup("fit")
        except ValueError as err:
            raise UsageError(" ".join(str(err).split())) from None
        train, val = dm._train.array, dm._val.array  # type: ignore[union-attr]
        tiles = np.arange(0, len(train) - args.block_size, args.block_size, dtype=np.int64)
        val_starts = even_starts(len(val), args.block_size, args.val_windows)
        content = dm.fingerprint()
        settings.update(block_size=args.block_size, val_windows=args.val_windows)
        meta = {"kind": "tokens", "block_size": args.block_size, "vocab_size": 256,
                "baselines": dm.baseline_bits_per_byte(), "corpus": {"files": len(dm.meta["train"]["files"])
                                                                     + len(dm.meta["val"]["files"]),
                                                                     "train_bytes": len(train),
                                                                     "val_bytes": len(val)}}
        length = args.block_size + 1
        fns = {"train": (functools.partial(_token_item, data=np.asarray(train), starts=tiles, length=length),
                         len(tiles)),
               "val": (functools.partial(_token_item, data=np.asarray(val), starts=val_starts, length=length),
                       len(val_starts))}
    settings["content"] = content
    meta.update(format=_stream_format(), source=args.source, settings=settings,
                source_digest=hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest())
    return meta, fns


def _stream_format() -> int:
    from datamodules.streaming import STREAM_FORMAT

    return STREAM_FORMAT


# ------------------------------------------------------------------------------------------------ destination
def _destination(url: str) -> tuple[Any, str]:
    from datamodules.verified_chunks import fresh_fs

    try:
        return fresh_fs(url)  # this call's environment: a cached instance may point at another store
    except (ImportError, ValueError) as err:
        raise UsageError(f"--output {url}: {err}") from None


@contextlib.contextmanager
def _store_calls(url: str) -> Iterator[None]:
    """Any failure of the store at ``url`` inside, as bad input in one line (:func:`_store_error`).

    The store's library raises its own types, not only ``OSError``: botocore's ``NoCredentialsError`` and
    ``ParamValidationError``, aiohttp's, gcsfs's. Each would end the tool in a traceback that may quote the URL.
    """
    try:
        yield
    except UsageError:
        raise
    except FileNotFoundError as err:  # not the bucket (the steps tell that apart themselves): a file it should hold
        raise UsageError(f"--output {url}: {' '.join(str(err).split())[:300]}") from None
    except Exception as err:
        raise _store_error(url, err) from None


def _store_error(url: str, err: BaseException) -> UsageError:
    """A store's refusal as bad input naming ``url`` (never the credentials)."""
    if isinstance(err, PermissionError):
        return UsageError(f"--output {url}: access denied; check the credentials")
    if isinstance(err, FileNotFoundError):
        return UsageError(f"--output {url}: the bucket or container does not exist")
    return UsageError(f"--output {url}: {type(err).__name__}: {' '.join(str(err).split())[:200]}")


def _read_json(fs: Any, path: str, url: str) -> dict[str, Any] | None:
    try:
        with fs.open(path, "rb") as handle:
            return json.loads(handle.read())
    except FileNotFoundError:
        if "://" in url:  # a missing bucket reads as a missing file too: tell the two apart
            bucket = path.split("/", 1)[0]
            try:
                fs.ls(bucket, refresh=True)
            except (FileNotFoundError, PermissionError, OSError) as err:
                raise _store_error(url, err) from None
        return None
    except (PermissionError, OSError) as err:
        raise _store_error(url, err) from None
    except ValueError:
        return {}


def check_destination(fs: Any, root: str, url: str, meta: dict[str, Any]) -> dict[str, Any] | None:
    """The ``atscale.json`` already at ``url`` when it is this dataset's; :class:`UsageError` when it is another's."""
    existing = _read_json(fs, f"{root}/atscale.json", url)
    if existing is None:
        try:
            present = fs.exists(root) and bool(fs.ls(root))
        except (PermissionError, OSError) as err:
            raise _store_error(url, err) from None
        if present:
            raise UsageError(f"--output {url} holds files that are not a prepared dataset (no atscale.json); "
                             "choose another --output or empty it first")
        return None
    if existing.get("source_digest") != meta["source_digest"]:
        raise UsageError(f"--output {url} already holds a different dataset (prepared from "
                         f"{existing.get('source', '?')}, digest {str(existing.get('source_digest', '?'))[:12]}; "
                         f"this one is {meta['source_digest'][:12]}); choose another --output or delete it first")
    return existing


# ------------------------------------------------------------------------------------------------------ steps
#: Items the split being made has written so far: shared with litdata's forked worker, read by the progress bar.
_items_done: Any = None


def _counted(fn: Callable[[int], Any]) -> Callable[[int], Any]:
    """``fn``, counting its calls in :data:`_items_done` (litdata's own bar moves only when a worker ends)."""

    def item(index: int) -> Any:
        _items_done.value += 1
        return fn(index)

    return item


def make_chunks(staging: Path, fns: dict[str, tuple[Callable[[int], Any], int]], chunks: dict[str, int]) -> None:
    """Each split's chunks under ``staging/<split>`` with ``litdata.optimize``; a split already made is kept.

    litdata's notes and its bar go to ``staging/<split>.log``; the terminal shows one bar per split, fed by the
    items the worker has written.
    """
    global _items_done
    import multiprocessing
    import threading

    from litdata import optimize
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    for split, (fn, count) in fns.items():
        folder = staging / split
        if (folder / "index.json").is_file():
            print(f"{split}: {count} items already in chunks at {folder}", file=sys.stderr)
            continue
        shutil.rmtree(folder, ignore_errors=True)  # a split cut short by a kill is made again whole
        scratch = staging / f".{split}.tmp"
        shutil.rmtree(scratch, ignore_errors=True)
        _items_done = multiprocessing.Value("q", 0, lock=False)  # before the fork: the worker inherits it
        finished = threading.Event()
        log_path = staging / f".{split}.log"
        size = f"{chunks['chunk_items']} items" if "chunk_items" in chunks else f"{chunks['chunk_bytes']:,} bytes"
        with Progress(TextColumn(f"{split}: chunks of {size}"), BarColumn(), MofNCompleteColumn(),
                      TimeRemainingColumn(), console=_stderr_console(), transient=False) as bar:
            task = bar.add_task(split, total=count)

            def follow(task: Any = task, bar: Progress = bar, finished: threading.Event = finished,
                       done: Any = _items_done) -> None:
                while not finished.wait(0.2):
                    bar.update(task, completed=done.value)

            follower = threading.Thread(target=follow, name="prepare-progress", daemon=True)
            follower.start()
            try:
                with open(log_path, "w") as log, contextlib.redirect_stdout(log), contextlib.redirect_stderr(log):
                    optimize(fn=_counted(fn), inputs=list(range(count)), output_dir=str(scratch),
                             chunk_size=chunks.get("chunk_items"), chunk_bytes=chunks.get("chunk_bytes"),
                             num_workers=1, mode="overwrite", start_method="fork")
            except Exception as err:
                raise RuntimeError(f"{split}: litdata could not write the chunks ({err}); its log: {log_path}") \
                    from err
            finally:
                finished.set()
                follower.join()
            bar.update(task, completed=_items_done.value)
        if _items_done.value != count:
            raise RuntimeError(f"{split}: litdata wrote {_items_done.value} of {count} items; its log: {log_path}")
        scratch.rename(folder)


def _stderr_console() -> Any:
    from rich.console import Console

    return Console(stderr=True)


def chunk_digests(staging: Path) -> dict[str, str]:
    """SHA-256 of every staged file, by its path under the dataset (``train/chunk-0-0.bin``)."""
    out = {}
    for path in sorted(staging.rglob("*")):
        if path.is_file() and not path.name.startswith("."):
            out[path.relative_to(staging).as_posix()] = hashlib.sha256(path.read_bytes()).hexdigest()
    return out


def upload(fs: Any, staging: Path, root: str, url: str, meta: dict[str, Any]) -> int:
    """Put the staged files under ``root`` (chunks first, the indexes next, ``atscale.json`` complete last).

    A file already there with the same size is kept (a relaunch after a kill resumes). Returns files sent.
    """
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn

    files = [p for p in sorted(staging.rglob("*")) if p.is_file() and not p.name.startswith(".")]
    files.sort(key=lambda p: p.name == "index.json")  # an index is published after its chunks
    try:
        there = {info["name"].rstrip("/"): int(info.get("size") or 0)
                 for info in fs.find(root, detail=True).values()} if fs.exists(root) else {}
    except (PermissionError, OSError) as err:
        raise _store_error(url, err) from None
    _write_json(fs, f"{root}/atscale.json", url, {**meta, "complete": False})
    sent = 0
    columns = (TextColumn("upload"), BarColumn(), DownloadColumn(), TimeRemainingColumn())
    with Progress(*columns, transient=False, disable=not sys.stderr.isatty()) as progress:
        task = progress.add_task("upload", total=sum(p.stat().st_size for p in files))
        for path in files:
            target = f"{root}/{path.relative_to(staging).as_posix()}"
            size = path.stat().st_size
            if there.get(target) != size:  # root came stripped from url_to_fs, as find() names files
                try:
                    if "://" not in url:  # a folder needs its parents; a bucket URL has none to make
                        fs.makedirs(target.rsplit("/", 1)[0], exist_ok=True)
                    fs.put_file(str(path), target)
                except (PermissionError, OSError) as err:
                    raise _store_error(url, err) from None
                sent += 1
            progress.advance(task, size)
    _write_json(fs, f"{root}/atscale.json", url, {**meta, "complete": True})
    return sent


def _write_json(fs: Any, path: str, url: str, value: dict[str, Any]) -> None:
    try:
        if "://" not in url:
            fs.makedirs(path.rsplit("/", 1)[0], exist_ok=True)
        with fs.open(path, "wb") as handle:
            handle.write(json.dumps(value, indent=1, sort_keys=True).encode())
    except (PermissionError, OSError) as err:
        raise _store_error(url, err) from None


def check_output(output: str) -> str:
    """``--output`` as the dataset's location (:func:`datamodules.urls.check_data_url`, no trailing ``/``); else
    :class:`UsageError` naming it, redacted: checked before any library sees the URL."""
    try:
        return check_data_url(output, "--output {url}").rstrip("/") or "/"
    except ValueError as err:
        raise UsageError(str(err)) from None


def prepare(args: argparse.Namespace) -> int:
    url = check_output(args.output)
    _check_positive(args)
    from datamodules.streaming import index_digest

    with _store_calls(url):
        fs, root = _destination(url)
    root = root.rstrip("/")
    meta, fns = describe(args)
    with _store_calls(url):
        existing = check_destination(fs, root, url, meta)
        if existing is not None and existing.get("complete"):
            print(f"{url} already holds this dataset (index digest {index_digest(url)[:12]}); nothing to do.")
            return 0
    staging = Path(args.staging) / meta["source_digest"][:16]
    staging.mkdir(parents=True, exist_ok=True)
    make_chunks(staging, fns, chunking(args))
    meta["files"] = chunk_digests(staging)
    meta["counts"] = {split: count for split, (_, count) in fns.items()}
    with _store_calls(url):
        sent = upload(fs, staging, root, url, meta)
        digest = index_digest(url)
    counts = ", ".join(f"{split} {count}" for split, count in meta["counts"].items())
    print(f"Prepared {url}: {counts} items, {len(meta['files'])} files ({sent} sent); index digest {digest}")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_or_exit(build_parser(), argv)

    def body() -> int:
        try:
            return prepare(args)
        except UsageError as err:
            raise UsageError(redact(str(err))) from None

    code = run_main(body)
    return code if code is not None else USAGE_EXIT_CODE


if __name__ == "__main__":
    sys.excepthook = excepthook  # a failure nothing turned into one line: its traceback, URLs redacted
    sys.exit(main())

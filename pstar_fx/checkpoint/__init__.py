"""Checkpoints that resume exactly: `step.save(path)` / `step.load(path)`.

Two formats, one `load` for both, from any world size into any world size:

Plain files (one process: the default). A directory of three ordinary files, each loadable with
`torch.load(path, weights_only=True)`, and their manifest:
- model.pt: the model's state dict, `step.state_dict()` (parameters at full precision, fp32 masters in mixed
  precision, and buffers), keyed as `model.state_dict()`: `model.load_state_dict(torch.load(...))` works in eager
  PyTorch too;
- optimizer.pt: `step.optimizer.state_dict()`, torch's format for the optimizer's class, options and states;
- meta.pt: the format version, the precision, the fp16 loss scaler (scale, good steps, growth settings) and the RNG
  states the step draws from: torch's CPU generator, and the device's CUDA generator when the step runs on CUDA, and
  the names of the frozen parameters model.pt leaves out (`step.save(path, frozen=False)`; a load keeps the model's
  own values for them);
- manifest.json: written last; says "plain" and gives each file's size and checksums (files.py).

Sharded (the default with several ranks or a disk tier; `step.save(path, sharded=True)` otherwise): a
torch.distributed.checkpoint directory (one `.distcp` file per rank, and `.metadata`, which here is pstar-fx's JSON
manifest holding DCP's metadata and the files' checksums, not DCP's pickle) in which each rank wrote only the pieces of
parameters and optimizer states it owns, with the same contents (see sharded.py). No rank gathers the model. Loading
reads each rank's pieces under the current world size and chunk layout, whatever saved it: a run saved at world size 2
resumes at world size 1 and the reverse. Load after the chunk store exists (after a step, or `step.lower(*batch)`) to
read only this rank's pieces; a load before it reads the values whole into the model and the optimizer (as the model is
whole on every rank until the first step), and the first step takes them. With several ranks every rank calls `save` and
`load`, with the same path, on a file system they share. The disk tier's states stream: a load reads into and writes
back one disk chunk at a time, and so does one rank's sharded save (each disk chunk's entries read from its file as
DCP's writer reaches them); a plain save, or a sharded one by several ranks, reads them all into host memory and refuses
(CheckpointError) where the host cannot hold them.

Across world sizes. Values, moments and step counts continue exactly (bit for bit in fp32 and mixed precision: a
run at world size W on a global batch equals, on this machine, a run at world size 1 with W micro-batches, which
computes the same sums). Rank r restores the RNG states that rank r % W_saved saved (its own at the same world
size); buffers, identical on every rank in data parallel, are written by one rank. A plain-files checkpoint loads at
any world size too (each rank memory-maps the files and copies its pieces); saving one with several ranks
(`sharded=False`) gathers every value on every rank and rank 0 writes.

Not in it: Python's `random` and NumPy's generators, a data loader's position and an lr scheduler's state (save
`sched.state_dict()` yourself) are the user's business; the compiled graphs are not saved (the first step after a
load traces again). Values are per parameter, not per chunk, so a checkpoint loads into a step compiled with another
chunk_size, budget or world size (or, plain files, into eager PyTorch).

What `load` reads, and how. It takes the format from the manifest alone (manifest.json: plain; else `.metadata`:
sharded; a stray `.metadata` beside a manifest.json changes nothing), checks the manifest's own checksum, then every
file it lists: there, of its size, and matching its checksums (with several ranks each rank checks a share of the
files and they agree before any goes on, and that they opened the same checkpoint: the same files, by their checksums;
DistributedError on every rank where not), before reading anything out of them. Then it reads: JSON (the manifest),
and `torch.load(weights_only=True)` for the plain files, for DCP's tensor pieces and for its byte entries ("pstar_fx",
"rng.<r>"): nothing else is unpickled, so a checkpoint cannot run code, whoever wrote it. Then it checks everything
before applying anything (this model's keys, shapes and dtypes; the optimizer state's structure and options; the
meta's format and precision; a finite, positive loss scale; RNG states the generator accepts; see
checks.py): a refused checkpoint raises CheckpointError (FileNotFoundError for a missing file),
naming the file and the cause, and leaves the step, the model, the optimizer, the scaler and the RNG states as they
were. The checksums catch corruption (flipped bits, truncation, a torn copy), not a deliberate forger, who can
rewrite the manifest too. Directories without a manifest (written by pstar-fx before manifests, or by anything
else) are refused: nothing would verify them, and this 0.x library has no archives of them to honour.

A save is atomic, and safe beside training: the step's lock (held by every step, save and load)
makes it read the state between two whole steps, never during one. The files are written into a fresh sibling
directory (each fsynced, the manifest last), which then takes the checkpoint's name by rename (by rank 0, after
every rank has written its part); an existing checkpoint there is renamed aside first and removed after. A save
that is interrupted leaves either the old checkpoint or the new one under `path`, or, between the two renames,
nothing under `path` and both beside it (the load error names them): never a half-written checkpoint that `load`
accepts. `save` replaces only a pstar-fx checkpoint (a directory with a manifest and nothing it does not list) or
an empty directory; anything else (the user's own model.pt) is refused and left as it is. After publishing, it
removes what killed saves to the same path left beside it (`<path>.tmp-*`, `<path>.old-*` holding only checkpoint
files). Where `path` is a symbolic link (to a directory, or dangling), all of this happens at the link's target,
followed link by link (files.save_target): the new checkpoint replaces the target, the link is kept and points at
it, and nothing is made beside the link; links that loop are refused. File system errors name the file and the
cause (disk full, read-only, permission denied).

The modules: save_load.py (the atomic save and the verified load, both formats), plain.py and sharded.py (the two
formats), files.py (manifest, checksums, the layout on disk), checks.py (contents checked before anything is
applied), dcp_storage.py (DCP's writer and reader, its metadata as JSON, the weights_only planner). All of them read
and write a step only through the `StepState` it hands over (step_state.py).
"""
from .plain import FILES
from .save_load import load, save
from .step_state import StepState

__all__ = ["save", "load", "StepState", "FILES"]

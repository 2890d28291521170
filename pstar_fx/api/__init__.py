"""The user-facing layer: `px.compile` and the CompiledStep it returns, forward-only evaluation, the model held by a
step, the live optimizer, summaries and the memory timeline, and `px.plan` (with its command line).

The public names are exported by `pstar_fx` itself; nothing is re-exported here, so that importing a module of
this package (`pstar_fx.api.plan`, `pstar_fx.api.compile`) never rebinds a public name to a module.
"""

"""Integrations of pstar-fx with other libraries' training loops, at the top of the layer order (above api).

Nothing here is imported by `import pstar_fx`: each integration imports its library (transformers for
`pstar_fx.integrations.hf`) only when it is itself imported, so those libraries stay optional
(`pip install "pstar-fx[hf]"`).
"""

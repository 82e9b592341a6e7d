"""The lifecycle ledger: every expected rollout reaches exactly one named terminal state.

Import what you need from the submodules (`rlsys.ledger.store`, `.queries`, `.reconcile`,
`.stream`); this package file stays empty so importing `rlsys.ledger.stream` does not load
SQLAlchemy.
"""

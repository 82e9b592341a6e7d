"""Every end of a job named: the driver's heartbeat and the end's reason on the job row,
and two more terminal rollout states (`failed_stream`, `failed_driver_lost`).

The trigger that keeps a terminal state final lists the terminal states it knows; it is
re-created here with the two new ones, so they are as final as the others.

Revision ID: 0002
Revises: 0001
"""

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None

# Frozen copies (a migration must not follow later edits of the code's enum).
TERMINAL_0001 = (
    "trained",
    "filtered_zero_variance",
    "filtered_stale",
    "failed_sandbox",
    "failed_engine",
    "failed_timeout",
    "failed_worker_lost",
    "failed_reward",
    "cancelled",
)
TERMINAL_0002 = (*TERMINAL_0001, "failed_stream", "failed_driver_lost")


def _sqlite_trigger(terminal: tuple[str, ...]) -> str:
    listed = ", ".join(f"'{s}'" for s in terminal)
    return f"""
CREATE TRIGGER trg_rollouts_terminal_is_final
BEFORE UPDATE OF state ON rollouts
FOR EACH ROW WHEN OLD.state IN ({listed}) AND NEW.state <> OLD.state
BEGIN SELECT RAISE(ABORT, 'rlsys: rollout is already in a terminal state'); END
"""


def _postgres_function(terminal: tuple[str, ...]) -> str:
    listed = ", ".join(f"'{s}'" for s in terminal)
    # CREATE OR REPLACE keeps the trigger that calls it.
    return f"""
CREATE OR REPLACE FUNCTION rlsys_reject_terminal_change() RETURNS trigger AS $$
BEGIN
  IF OLD.state IN ({listed}) AND NEW.state <> OLD.state THEN
    RAISE EXCEPTION 'rlsys: rollout % is already in terminal state %', OLD.id, OLD.state
      USING ERRCODE = '23514';
  END IF;
  RETURN NEW;
END $$ LANGUAGE plpgsql
"""


def _terminal_guard(terminal: tuple[str, ...]) -> None:
    dialect = op.get_bind().dialect.name
    if dialect == "sqlite":
        op.execute("DROP TRIGGER IF EXISTS trg_rollouts_terminal_is_final")
        op.execute(_sqlite_trigger(terminal))
    elif dialect == "postgresql":
        op.execute(_postgres_function(terminal))


def upgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.add_column(sa.Column("heartbeat_at", sa.Float(), nullable=True))
        batch.add_column(sa.Column("end_reason", sa.Text(), nullable=True))
    _terminal_guard(TERMINAL_0002)


def downgrade() -> None:
    _terminal_guard(TERMINAL_0001)
    with op.batch_alter_table("jobs") as batch:
        batch.drop_column("end_reason")
        batch.drop_column("heartbeat_at")

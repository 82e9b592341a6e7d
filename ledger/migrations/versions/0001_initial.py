"""Initial ledger schema: jobs, rollouts, history, events, owners, trainer steps.

Revision ID: 0001
Revises:
"""

import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None

# Frozen copy of the terminal states at this revision (a migration must not follow later
# edits of the code's enum).
TERMINAL = (
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
_TERMINAL_SQL = ", ".join(f"'{s}'" for s in TERMINAL)

SQLITE_TRIGGER = f"""
CREATE TRIGGER trg_rollouts_terminal_is_final
BEFORE UPDATE OF state ON rollouts
FOR EACH ROW WHEN OLD.state IN ({_TERMINAL_SQL}) AND NEW.state <> OLD.state
BEGIN SELECT RAISE(ABORT, 'rlsys: rollout is already in a terminal state'); END
"""

POSTGRES_FUNCTION = f"""
CREATE FUNCTION rlsys_reject_terminal_change() RETURNS trigger AS $$
BEGIN
  IF OLD.state IN ({_TERMINAL_SQL}) AND NEW.state <> OLD.state THEN
    RAISE EXCEPTION 'rlsys: rollout % is already in terminal state %', OLD.id, OLD.state
      USING ERRCODE = '23514';
  END IF;
  RETURN NEW;
END $$ LANGUAGE plpgsql
"""

POSTGRES_TRIGGER = """
CREATE TRIGGER trg_rollouts_terminal_is_final
BEFORE UPDATE OF state ON rollouts
FOR EACH ROW EXECUTE FUNCTION rlsys_reject_terminal_change()
"""


def upgrade() -> None:
    op.create_table(
        "jobs",
        sa.Column("id", sa.String(64), nullable=False),
        sa.Column("name", sa.String(200), nullable=False),
        sa.Column("config", sa.JSON(), nullable=False),
        sa.Column("status", sa.String(32), nullable=False),
        sa.Column("created_at", sa.Float(), nullable=False),
        sa.Column("ended_at", sa.Float(), nullable=True),
        sa.PrimaryKeyConstraint("id", name="pk_jobs"),
    )
    op.create_index("ix_jobs_status", "jobs", ["status"])
    op.create_table(
        "rollouts",
        sa.Column("id", sa.String(64), nullable=False),
        sa.Column("job_id", sa.String(64), nullable=False),
        sa.Column("group_id", sa.String(64), nullable=False),
        sa.Column("task_id", sa.String(200), nullable=False),
        sa.Column("session_id", sa.String(64), nullable=False),
        sa.Column("attempt", sa.Integer(), nullable=False),
        sa.Column("retry_of", sa.String(64), nullable=True),
        sa.Column("state", sa.String(32), nullable=False),
        sa.Column("state_seq", sa.Integer(), nullable=False),
        sa.Column("owner", sa.String(128), nullable=True),
        sa.Column("policy_version_first", sa.Integer(), nullable=True),
        sa.Column("policy_version_last", sa.Integer(), nullable=True),
        sa.Column("trained_version", sa.Integer(), nullable=True),
        sa.Column("prompt_tokens", sa.Integer(), nullable=False),
        sa.Column("completion_tokens", sa.Integer(), nullable=False),
        sa.Column("turns", sa.Integer(), nullable=False),
        sa.Column("reward", sa.Float(), nullable=True),
        sa.Column("reason", sa.Text(), nullable=True),
        sa.Column("created_at", sa.Float(), nullable=False),
        sa.Column("updated_at", sa.Float(), nullable=False),
        sa.Column("ended_at", sa.Float(), nullable=True),
        sa.ForeignKeyConstraint(["job_id"], ["jobs.id"], name="fk_rollouts_job_id_jobs"),
        sa.ForeignKeyConstraint(
            ["retry_of"], ["rollouts.id"], name="fk_rollouts_retry_of_rollouts"
        ),
        sa.PrimaryKeyConstraint("id", name="pk_rollouts"),
    )
    op.create_index("ix_rollouts_job_id", "rollouts", ["job_id"])
    op.create_index("ix_rollouts_group_id", "rollouts", ["group_id"])
    op.create_index("ix_rollouts_retry_of", "rollouts", ["retry_of"])
    op.create_index("ix_rollouts_job_id_state", "rollouts", ["job_id", "state"])
    op.create_table(
        "rollout_transitions",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("transition_id", sa.String(64), nullable=False),
        sa.Column("rollout_id", sa.String(64), nullable=False),
        sa.Column("seq", sa.Integer(), nullable=False),
        sa.Column("from_state", sa.String(32), nullable=True),
        sa.Column("to_state", sa.String(32), nullable=False),
        sa.Column("is_terminal", sa.Boolean(), nullable=False),
        sa.Column("at", sa.Float(), nullable=False),
        sa.Column("reason", sa.Text(), nullable=True),
        sa.ForeignKeyConstraint(
            ["rollout_id"], ["rollouts.id"], name="fk_rollout_transitions_rollout_id_rollouts"
        ),
        sa.PrimaryKeyConstraint("id", name="pk_rollout_transitions"),
        sa.UniqueConstraint("transition_id", name="uq_rollout_transitions_transition_id"),
        sa.UniqueConstraint("rollout_id", "seq", name="uq_rollout_transitions_rollout_id_seq"),
    )
    op.create_index(
        "uq_rollout_transitions_one_terminal",
        "rollout_transitions",
        ["rollout_id"],
        unique=True,
        sqlite_where=sa.text("is_terminal"),
        postgresql_where=sa.text("is_terminal"),
    )
    op.create_table(
        "rollout_events",
        sa.Column("id", sa.String(64), nullable=False),
        sa.Column("rollout_id", sa.String(64), nullable=False),
        sa.Column("job_id", sa.String(64), nullable=False),
        sa.Column("kind", sa.String(32), nullable=False),
        sa.Column("turn", sa.Integer(), nullable=True),
        sa.Column("at", sa.Float(), nullable=False),
        sa.Column("tokens", sa.Integer(), nullable=True),
        sa.Column("data", sa.JSON(), nullable=True),
        sa.ForeignKeyConstraint(
            ["rollout_id"], ["rollouts.id"], name="fk_rollout_events_rollout_id_rollouts"
        ),
        sa.PrimaryKeyConstraint("id", name="pk_rollout_events"),
    )
    op.create_index("ix_rollout_events_rollout_id", "rollout_events", ["rollout_id"])
    op.create_index("ix_rollout_events_job_id", "rollout_events", ["job_id"])
    op.create_table(
        "owners",
        sa.Column("id", sa.String(128), nullable=False),
        sa.Column("job_id", sa.String(64), nullable=False),
        sa.Column("heartbeat_at", sa.Float(), nullable=False),
        sa.Column("expires_at", sa.Float(), nullable=False),
        sa.PrimaryKeyConstraint("id", name="pk_owners"),
    )
    op.create_index("ix_owners_job_id", "owners", ["job_id"])
    op.create_table(
        "trainer_steps",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("job_id", sa.String(64), nullable=False),
        sa.Column("step", sa.Integer(), nullable=False),
        sa.Column("policy_version", sa.Integer(), nullable=False),
        sa.Column("at", sa.Float(), nullable=False),
        sa.Column("metrics", sa.JSON(), nullable=False),
        sa.ForeignKeyConstraint(["job_id"], ["jobs.id"], name="fk_trainer_steps_job_id_jobs"),
        sa.PrimaryKeyConstraint("id", name="pk_trainer_steps"),
        sa.UniqueConstraint("job_id", "step", name="uq_trainer_steps_job_id_step"),
    )
    op.create_index("ix_trainer_steps_job_id", "trainer_steps", ["job_id"])

    dialect = op.get_bind().dialect.name
    if dialect == "sqlite":
        op.execute(SQLITE_TRIGGER)
    elif dialect == "postgresql":
        op.execute(POSTGRES_FUNCTION)
        op.execute(POSTGRES_TRIGGER)


def downgrade() -> None:
    dialect = op.get_bind().dialect.name
    op.execute(
        "DROP TRIGGER IF EXISTS trg_rollouts_terminal_is_final"
        + (" ON rollouts" if dialect == "postgresql" else "")
    )
    if dialect == "postgresql":
        op.execute("DROP FUNCTION IF EXISTS rlsys_reject_terminal_change()")
    for table in ("trainer_steps", "owners", "rollout_events", "rollout_transitions"):
        op.drop_table(table)
    op.drop_table("rollouts")
    op.drop_table("jobs")

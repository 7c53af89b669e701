"""Completions as the trainer sees them: the rollout engine (`n` completions per prompt from one
prefill, lanes reused as they finish, every token's log-probs) and the trainer's per-token
log-probs of (prompt, completion) sequences on packed rows."""

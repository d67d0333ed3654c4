"""The decode core: the draft -> verify -> commit engine, sampling and acceptance, draft-length
policies, machine costs, stop strings and statistics (docs/design.md, "Engine")."""

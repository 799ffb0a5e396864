"""Frontend: DSL text -> located syntax tree -> IR graph."""

"""The IR: scalar expressions (`expr`), graph ops (`ops`), the graph with verifier and printer."""

"""The runtime every layer stands on (private): MPI start-up and the
communicator argument (mpi), settings (config), launcher detection
(launch), topology, the ranks' agreement on a collective's arguments
(argument_agreement) and on the model they train (model_consistency),
argument checks (args), dtype codes (dtypes), the model's checks
(model_checks), flat buffers, broadcasts of a model's state
(state_broadcast), hook handles, and fault-tolerant mode's state and
per-step agreements (fault_tolerant_mode)."""

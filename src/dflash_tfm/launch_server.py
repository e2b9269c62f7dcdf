"""`python -m dflash_tfm.launch_server` (also `dflash-tfm serve`): load one engine and serve it over HTTP.

Same flags as the original system's launcher (see `dflash_tfm.server.args`). Flag errors and load errors
(missing checkpoint, impossible settings) print one `error:` line and exit with status 2 before any port is
opened, so a benchmark waiting on /health fails fast instead of timing out.

At `--tp-size N` the command starts its N ranks itself (`parallel/launch.py`; under `torchrun` it is one of
them): rank 0 serves HTTP and the other ranks follow each request its engine runs (`Engine.follow`).
"""
from __future__ import annotations

import logging
import sys

from dflash_tfm.server.args import log_start_warnings, parse_server_args

logger = logging.getLogger("dflash_tfm.server")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_server_args(argv)
    if args.tp_size > 1:
        from dflash_tfm.parallel.launch import launched_by_a_launcher, relaunch

        if not launched_by_a_launcher():  # one process per rank, started here; rank 0 serves
            try:
                return relaunch(args.tp_size, "dflash_tfm.launch_server", argv, args.device, args.ep_size)
            except ValueError as e:
                print(f"launch_server: error: {e}", file=sys.stderr)
                return 2
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    log_start_warnings(args)

    import uvicorn

    from dflash_tfm.engine.engine import Engine
    from dflash_tfm.errors import CheckpointError
    from dflash_tfm.parallel.group import destroy_tensor_parallel, is_first_rank
    from dflash_tfm.server.app import create_app
    from dflash_tfm.server.http_protocol import protocol_with_header_timeout

    try:
        engine = Engine(args.model_path, args.speculative, device=args.device, dtype=args.dtype,
                        quantization=args.quantization,
                        max_model_len=args.max_model_len, use_cuda_graph=not args.disable_cuda_graph,
                        tp_size=args.tp_size, ep_size=args.ep_size,
                        max_running_requests=args.max_running_requests)
    except (FileNotFoundError, CheckpointError, ValueError, NotImplementedError) as e:
        print(f"launch_server: error: {e}", file=sys.stderr)
        return 2
    if not is_first_rank():  # at --tp-size N rank 0 serves; the others decode each request with it
        engine.follow()
        destroy_tensor_parallel()
        return 0
    logger.info("%s", engine.kernel_path)
    logger.info("serving %s (max_model_len %d, speculative %s) on http://%s:%d; decoding up to %d requests "
                "together, admitting up to %d", engine.model_path.name, engine.max_model_len,
                args.speculative.algorithm or "off (autoregressive)", args.host, args.port,
                engine.max_running_requests, args.max_admitted_requests)
    try:
        uvicorn.run(create_app(engine, args), host=args.host, port=args.port, log_level=args.log_level,
                    http=protocol_with_header_timeout(args.timeout_read), timeout_keep_alive=args.timeout_keep_alive,
                    timeout_graceful_shutdown=5)
    finally:
        engine.release_followers()
        destroy_tensor_parallel()
    return 0


if __name__ == "__main__":
    sys.exit(main())

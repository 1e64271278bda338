from longstraw.bench.commands import bench_app

bench_app()

from agent.cli.run import main

raise SystemExit(main())

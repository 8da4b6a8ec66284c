// Validates Prometheus Operator custom resources (JSON array on stdin) with the validators that
// @kubernetes-models/prometheus-operator generates from the operator's CRD schemas.
// Prints one line per invalid object and exits 1 if any; unknown kinds are errors too.
// Usage: node validate_monitoring.mjs <node_modules/@kubernetes-models/prometheus-operator> < objects.json
import { readFileSync } from "node:fs";
import { join } from "node:path";
import { pathToFileURL } from "node:url";

const models = process.argv[2];
const v1 = await import(pathToFileURL(join(models, "monitoring.coreos.com", "v1", "index.js")).href);

const objects = JSON.parse(readFileSync(0, "utf8"));
let failures = 0;
for (const object of objects) {
  const Model = object.apiVersion === "monitoring.coreos.com/v1" ? v1[object.kind] : undefined;
  const name = `${object.kind}/${object.metadata?.name}`;
  try {
    if (!Model) throw new Error(`no schema for ${object.apiVersion} ${object.kind}`);
    new Model(object).validate();
    console.log(`ok ${name}`);
  } catch (error) {
    failures++;
    console.log(`INVALID ${name}: ${error.message}`);
  }
}
process.exit(failures ? 1 : 0);
